"""The agent: the node's engine table, and what every part of the agent does to an engine through it.

`Agent` owns the records (`engines`) and the specs, the process watches (`watcher`: single engines and a TP group's
rank 0; `ranks`: a group's followers), the crash-loop backoffs and the background tasks; it publishes and saves
records, waits for an engine's "ready", stops, kills and retires engines, and runs the desired-state loop
(`supervision.plan`). The other jobs are parts of their own, each holding its own state and reaching the table only
through what its `Host` protocol names (table.py's `EngineTable` and `FaultReporter`, and its own additions; no part
imports this module):
- starts.py (`Starts`): admission (the replica cap, a crash-looping spec's backoff) and spawning;
- detection.py (`Detection`): the one `FaultDetected` per engine generation; exits, heartbeats, TP followers;
- probes.py (`Probes`): stuck HTTP servers;
- links.py (`Links`): the engines' links, their registrations and frames;
- adoption.py (`Adoption`): engines this agent did not start, or started in an earlier life;
- gpu_health.py (`GpuHealth`): the node's GPUs, and what a GPU's failure does.
Built beside it in app.py, likewise through a `Host` protocol of their own: takeover.py (`Takeovers`), commands.py
(`Commands`: spawn, stop, list) and incident_ends.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

from libs.common.bus import Bus
from libs.common.errors import Conflict, HoldfastError, NotFound
from libs.common.events import (
    EngineInfo,
    EngineRole,
    EngineSpec,
    EngineStopped,
    Event,
    FaultKind,
    Freeze,
    FreezeReply,
    RankProcess,
    RestartBackoff,
)
from services.agent import shadows, supervision
from services.agent.adoption import Adoption
from services.agent.backoff import BackoffPolicy, Backoffs
from services.agent.detection import Detection
from services.agent.engines import EngineRecord, Ev, State
from services.agent.gpu_health import GpuHealth
from services.agent.links import Links
from services.agent.pidfd import ExitStatus, PidWatcher
from services.agent.probes import Probes
from services.agent.rank_watch import RankWatch
from services.agent.records import RecordWriter
from services.agent.settings import AgentSettings
from services.agent.starts import Starts

log = logging.getLogger("holdfast.agent")
LOCAL_FREEZE_S = 2.0  # the agent's own freeze (takeover.py `promote`); a manager slower: the control plane's path


class Agent:
    def __init__(self, settings: AgentSettings, bus: Bus, writer: RecordWriter) -> None:
        self.settings = settings
        self.node = settings.node
        self.bus = bus
        self.writer = writer
        self.engines: dict[str, EngineRecord] = {}
        self.specs: dict[str, EngineSpec] = {}
        self.detection = Detection(self)
        self.watcher = PidWatcher(self.detection.on_exit, on_exiting=self.detection.exiting, zombie_status=True)
        self.ranks = RankWatch(self.detection.rank_died)  # TP groups' followers (rank 0 is in `watcher`)
        self.links = Links(self)
        self.adoption = Adoption(self)
        self.starts = Starts(self)
        self.probes = Probes(self)
        self.gpu_health = GpuHealth(self)
        # takeover.py's `Takeovers.promote`, set by app.py: a death's standby promoted by this agent
        self.promoter: Callable[[EngineRecord, FaultKind], bool] | None = None
        # takeover.py's `Takeovers.resume`, set by app.py: a standby assigned by this agent's previous life
        self.resumer: Callable[[EngineRecord], None] | None = None
        self._ready_waiters: dict[str, list[asyncio.Future[EngineRecord]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reconcile_now = asyncio.Event()
        self.starts_from = 0.0  # monotonic: the reconciler starts nothing before (`supervision.plan`)
        self._no_spare: dict[str, str] = {}  # spec key -> why its spare cannot start now (logged once a reason)
        self._no_start: dict[tuple[str, EngineRole], str] = {}  # (spec key, role) -> why it cannot start now (so)
        self.backoffs = Backoffs(BackoffPolicy(base_s=settings.crash_backoff_base_s,
                                               max_s=settings.crash_backoff_max_s,
                                               reset_s=settings.crash_backoff_reset_s))

    # ------------------------------------------------------------ the table, publication, background tasks

    def background(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    def publish(self, payload: Event) -> None:
        # Until the stream has it: a fault published as the NATS server in use dies must not be lost (the
        # client reconnects to another server; a retry is stored once, by its Nats-Msg-Id).
        self.background(self.bus.emit_until_stored(payload), f"emit:{payload.type}")  # type: ignore[attr-defined]

    def info(self, rec: EngineRecord) -> EngineInfo:
        info = rec.info(self.node)
        uuid = self.uuid_of(rec.gpu)
        return info if uuid is None else info.model_copy(update={"gpu_uuid": uuid})

    def uuid_of(self, gpu: int) -> str | None:
        return self.gpu_health.uuid_of(gpu)

    def save(self, rec: EngineRecord) -> None:
        self.writer.put_engine(self.info(rec))

    def get(self, engine_id: str) -> EngineRecord:
        rec = self.engines.get(engine_id)
        if rec is None:
            raise NotFound(f"no engine {engine_id!r} on node {self.node}")
        return rec

    def records(self) -> list[EngineRecord]:
        return list(self.engines.values())

    # ------------------------------------------------------------ what the parts share

    def start_engine(self, key: str, role: EngineRole, *, engine_id: str | None = None, generation: int = 0,
                     extra_env: dict[str, str] | None = None, spec: EngineSpec | None = None,
                     replacing: EngineRecord | None = None, gang: str | None = None,
                     same_gpu: bool = True, spare: bool = False) -> EngineRecord:
        """Start one engine (starts.py); every start goes through here (metrics.py counts them)."""
        return self.starts.start(key, role, engine_id=engine_id, generation=generation, extra_env=extra_env,
                                 spec=spec, replacing=replacing, gang=gang, same_gpu=same_gpu, spare=spare)

    def fault(self, rec: EngineRecord, kind: FaultKind, *, exit_code: int | None = None, sig: int | None = None,
              detail: str = "", died_at: float | None = None, rank: int | None = None) -> bool:
        """Publish this generation's one FaultDetected (detection.py); False when it was already published."""
        return self.detection.fault(rec, kind, exit_code=exit_code, sig=sig, detail=detail, died_at=died_at,
                                    rank=rank)

    def watch_followers(self, rec: EngineRecord, followers: list[RankProcess]) -> None:
        self.detection.watch_followers(rec, followers)

    def promote(self, rec: EngineRecord, kind: FaultKind) -> None:
        """A death just reported: its standby promoted here, where takeover.py's `promote` may (app.py sets it)."""
        if self.promoter is not None:
            self.promoter(rec, kind)

    def inherited(self, rec: EngineRecord) -> None:
        """A standby registered assigned by this agent's previous life (links.py): its takeover resumed (app.py sets
        takeover.py's `resume`)."""
        if self.resumer is not None:
            self.resumer(rec)

    def gpu_sound(self, gpu: int) -> bool:
        return gpu not in self.gpu_health.unhealthy

    async def freeze(self, cmd: Freeze) -> FreezeReply:
        """This node's gpu_manager freezes an engine's leases (the agent's own promotion, takeover.py)."""
        return await self.bus.request(self.node, cmd, FreezeReply, timeout=LOCAL_FREEZE_S)

    async def assign(self, rec: EngineRecord, msg: dict[str, Any]) -> None:
        """Send `msg` over the engine's link (links.py); ConnectionError without one."""
        await self.links.assign(rec, msg)

    async def wait_ready(self, engine_id: str, within_s: float) -> EngineRecord:
        """The record once the engine says ready; raises if it dies (or faults) first."""
        rec = self.get(engine_id)
        if rec.state in (State.READY,) or (rec.state is State.STANDBY and rec.role is EngineRole.STANDBY):
            return rec
        fut: asyncio.Future[EngineRecord] = asyncio.get_running_loop().create_future()
        self._ready_waiters.setdefault(engine_id, []).append(fut)
        # asyncio.timeout, not wait_for: the waiter resumes straight from the future (wait_for adds hops
        # through the event loop, each one behind whatever else is queued there)
        async with asyncio.timeout(within_s):
            return await fut

    def resolve_ready(self, rec: EngineRecord, exc: BaseException | None = None) -> None:
        for fut in self._ready_waiters.pop(rec.engine_id, []):
            if not fut.done():
                if exc is None:
                    fut.set_result(rec)
                else:
                    fut.set_exception(exc)

    # ------------------------------------------------------------ stopping, killing, retiring

    async def kill_confirmed(self, rec: EngineRecord, within_s: float = 5.0) -> ExitStatus | None:
        """SIGKILL through the pidfd and wait for the pidfd to say it is dead (a hung owner still maps memory)."""
        if not self.watcher.watching(rec.engine_id):
            return None  # already dead (or never watched: not a process of this node any more)
        self.watcher.signal(rec.engine_id, signal.SIGKILL)
        if rec.tp > 1:  # its followers at once, not after rank 0's teardown (rank_watch.py invariant 6)
            self.ranks.kill(rec.engine_id)
        return await self.watcher.wait_dead(rec.engine_id, within_s)

    async def stop(self, engine_id: str) -> int | None:
        rec = self.get(engine_id)
        if rec.state is State.FAILED:
            await self.kill_confirmed(rec)
            self.retire(rec)
            return rec.exit_code
        if rec.state is State.STOPPING:
            raise Conflict(f"engine {engine_id} is already stopping")
        rec.transition(Ev.STOP)
        self.save(rec)
        if self.watcher.watching(engine_id):
            self.watcher.signal(engine_id, signal.SIGTERM)
            try:
                await self.watcher.wait_dead(engine_id, self.settings.stop_timeout_s)
            except TimeoutError:
                await self.kill_confirmed(rec)
        elif rec.engine_id in self.engines:
            self.gone(rec)
        return rec.exit_code

    def gone(self, rec: EngineRecord) -> None:
        """The process no longer exists: drop its link; a stopped engine's record goes away."""
        self.ranks.forget(rec.engine_id)  # a group's rank 0: its followers die with it (PR_SET_PDEATHSIG)
        self.links.drop(rec.engine_id)
        if rec.state is State.STOPPING:
            rec.transition(Ev.GONE)
            self.publish(EngineStopped(engine_id=rec.engine_id, exit_code=rec.exit_code))
            if not rec.handing_over:  # a takeover's predecessor keeps its slot until the takeover retires it
                self.engines.pop(rec.engine_id, None)
                self.writer.delete_engine(self.node, rec.engine_id)
        self.resolve_ready(rec, RuntimeError(f"engine {rec.engine_id} exited"))

    def retire(self, rec: EngineRecord) -> None:
        """Forget a failed engine whose fault has been handled (taken over, or replaced)."""
        if rec.state is State.FAILED and not self.watcher.watching(rec.engine_id):
            rec.transition(Ev.GONE)
        elif rec.state is State.FAILED:
            return  # still alive (hung): kill_confirmed first
        self.engines.pop(rec.engine_id, None)
        self.watcher.forget(rec.engine_id)
        self.ranks.forget(rec.engine_id)
        self.writer.delete_engine(self.node, rec.engine_id)

    def memory_gone(self, rec: EngineRecord, why: str) -> None:
        """No takeover will come for this failed engine's memory (its incident has ended): it is replaced now
        rather than at the end of `takeover_wait_s`."""
        if rec.memory_lost or rec.state is not State.FAILED:
            return
        rec.memory_lost = True
        log.info("engine %s: %s; no takeover will come: replaced now", rec.engine_id, why)
        self.reconcile_soon()

    # ------------------------------------------------------------ desired state

    def reconcile_soon(self) -> None:
        self._reconcile_now.set()

    async def reconcile_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._reconcile_now.wait(), self.settings.reconcile_interval_s)
            except TimeoutError:
                pass
            self._reconcile_now.clear()
            await self.reconcile()

    def backoff_report(self) -> list[RestartBackoff]:
        now = time.monotonic()
        return [RestartBackoff(spec_key=key, failures=b.failures, delay_s=b.delay_s,
                               retry_in_s=round(self.backoffs.retry_in(key, now), 3))
                for key, b in sorted(self.backoffs.by_key.items())]

    async def reconcile(self) -> None:
        now = time.monotonic()
        for rec in self.records():
            if rec.spec_key is not None and rec.state in (State.READY, State.STANDBY):
                self.backoffs.note_up(rec.spec_key, now, rec.spawned_mono)
        p = supervision.plan(self.specs, self.records(), now, self.settings.takeover_wait_s, self.backoffs,
                             self.starts_from)
        if now < self.starts_from and p.held:
            asyncio.get_running_loop().call_later(self.starts_from - now, self.reconcile_soon)
        for engine_id in p.stop:
            extra = self.engines.get(engine_id)
            if extra is not None and extra.live:
                log.info("stopping standby %s: more than its spec wants", engine_id)
                self.background(self.stop(engine_id), f"stop:{engine_id}")
        for engine_id in p.retire:
            retiring = self.engines.get(engine_id)
            if retiring is not None:
                await self.kill_confirmed(retiring)
                self.retire(retiring)
        for key, role in p.start:
            try:
                self.start_engine(key, role)
                self._no_start.pop((key, role), None)
            except (OSError, ValueError, HoldfastError) as e:
                # said once per reason (each reconcile, twice a second, tries again while every GPU is unhealthy)
                if self._no_start.get((key, role)) != str(e):
                    log.error("cannot start a %s engine of %s: %s", role.value, key, e)
                self._no_start[(key, role)] = str(e)
        for key in p.spares:
            try:
                self.start_engine(key, EngineRole.STANDBY, spare=True)
                self._no_spare.pop(key, None)
            except (OSError, ValueError, HoldfastError) as e:
                if self._no_spare.get(key) != str(e):  # said once per reason: it holds until a GPU is free
                    log.warning("no spare for %s: %s", key, e)
                self._no_spare[key] = str(e)
        await shadows.reconcile(self)

    async def close(self) -> None:
        self.links.close()
        self.watcher.close()
        self.ranks.close()
        self.gpu_health.close()
        for task in list(self._tasks):
            task.cancel()
