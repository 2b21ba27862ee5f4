"""The agent's core: engine records, process watching, the link with engines, and fault publication.

Every observation (a pidfd turning readable, an engine's or a TP group follower's (rank_watch.py), a heartbeat
deadline, a fatal report, an NVML event) goes through `fault()`, which publishes at most one `FaultDetected` per
engine generation (`latch_fault`).
Publication happens before any etcd write: the detection path is one JetStream publish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Coroutine
from typing import Any

from libs.common.bus import Bus
from libs.common.errors import (
    Conflict,
    HoldfastError,
    MalformedMessage,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from libs.common.events import (
    EngineInfo,
    EngineReady,
    EngineRole,
    EngineSpec,
    EngineStarted,
    EngineStopped,
    Event,
    FaultDetected,
    FaultKind,
    MarkGpu,
    MarkGpuReply,
    RankProcess,
    RestartBackoff,
    SetGpuHealth,
    SetGpuHealthReply,
)
from libs.common.gpu import GpuEntry, resolve_gpu, simulated_gpus
from libs.common.ids import new_id, subject_token
from libs.common.wire import FrameStream
from services.agent import gpus, launcher, rank_watch, shadows, supervision
from services.agent.backoff import BackoffPolicy, Backoffs
from services.agent.engines import EngineRecord, Ev, State, weights_loaded
from services.agent.gpu_reports import GpuReports
from services.agent.gpu_wishes import WISHES_FILE, GpuWishes
from services.agent.pidfd import ExitStatus, PidWatcher, end_process, known_fault, proc_start_time
from services.agent.rank_watch import RankWatch
from services.agent.records import RecordWriter
from services.agent.settings import AgentSettings

log = logging.getLogger("holdfast.agent")
REPORT_WAIT_S = 5.0  # how long a MarkGpu waits for the gpu_manager's answer (the report goes on after)
GROUP_DIED = 70  # a TP group's rank 0 exits so when another rank died (engines/reference/tp_runner.py)


class Agent:
    def __init__(self, settings: AgentSettings, bus: Bus, writer: RecordWriter) -> None:
        self.settings = settings
        self.node = settings.node
        self.bus = bus
        self.writer = writer
        self.engines: dict[str, EngineRecord] = {}
        self.specs: dict[str, EngineSpec] = {}
        self.links: dict[str, FrameStream] = {}
        self.watcher = PidWatcher(self._on_exit)
        self.ranks = RankWatch(self._rank_died)  # TP groups' followers (rank 0 is in `watcher`)
        self._ready_waiters: dict[str, list[asyncio.Future[EngineRecord]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ending: set[int] = set()  # pids of refused strangers being ended (_end_refused)
        self.faults_published = 0
        self._listened_at: float | None = None  # the heartbeat monitor's last pass (monotonic)
        self._reconcile_now = asyncio.Event()
        # The node's GPUs (NVML's, or the host backend's simulated list: app.py sets them) and the unhealthy ones.
        self.gpus: list[GpuEntry] = simulated_gpus(settings.gpus, settings.node)
        self.unhealthy: dict[int, str] = {}
        # told to the gpu_manager until it answers, even across this agent's death (kept in the state dir by UUID)
        wishes = GpuWishes(settings.state_dir / WISHES_FILE, lambda gpu: resolve_gpu(gpu, self.gpus).uuid)
        self.gpu_reports = GpuReports(self._send_gpu_health, wishes)
        self.backoffs = Backoffs(BackoffPolicy(base_s=settings.crash_backoff_base_s,
                                               max_s=settings.crash_backoff_max_s,
                                               reset_s=settings.crash_backoff_reset_s))

    # ------------------------------------------------------------ helpers

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
        return next((g.uuid for g in self.gpus if g.index == gpu), None)

    def save(self, rec: EngineRecord) -> None:
        self.writer.put_engine(self.info(rec))

    def get(self, engine_id: str) -> EngineRecord:
        rec = self.engines.get(engine_id)
        if rec is None:
            raise NotFound(f"no engine {engine_id!r} on node {self.node}")
        return rec

    def records(self) -> list[EngineRecord]:
        return list(self.engines.values())

    # ------------------------------------------------------------ starting

    def admit_active(self, key: str, *, replacing: EngineRecord | None = None, candidate: str | None = None) -> None:
        """Raise Conflict (and say so in the log) when one more active engine of `key` would exceed its spec's
        `replicas` (supervision.admit_active: the one rule, whatever path the engine comes by)."""
        why = supervision.admit_active(self.specs, self.records(), key, replacing=replacing, candidate=candidate)
        if why is not None:
            log.warning("refused an active engine: %s", why)
            raise Conflict(why)

    def admit_fresh_start(self, key: str) -> None:
        """Raise Unavailable while `key`'s engines crash-loop (its backoff, as the reconciler's starts wait it out).
        Asked of a start from outside (a cold start's Spawn): without it each cold engine that dies at once made
        its own incident, whose fallback spawned the next one at once (chains of `cs-inc-cs-inc-...` one or two
        seconds apart on the H200 while every engine exited at start)."""
        wait = self.backoffs.retry_in(key, time.monotonic())
        if wait > 0:
            why = f"engines of {key} keep failing: no new one for {wait:.1f} s"
            log.warning("refused a start: %s", why)
            raise Unavailable(why)

    def start_engine(self, key: str, role: EngineRole, *, engine_id: str | None = None, generation: int = 0,
                     extra_env: dict[str, str] | None = None, spec: EngineSpec | None = None,
                     replacing: EngineRecord | None = None, gang: str | None = None) -> EngineRecord:
        """Start one engine (a TP spec: its rank 0, which starts the others; `gang`: a successor group keeps its
        predecessor's gang id, a first group's is its own engine id)."""
        spec = spec or self.specs[key]
        engine_id = engine_id or new_id(subject_token(spec.model))
        if engine_id in self.engines and self.engines[engine_id].live:
            raise Conflict(f"engine {engine_id} already runs")
        if role is EngineRole.ACTIVE:
            self.admit_active(key, replacing=replacing)
        where = gpus.pick_gpu(spec, key, role, self.gpus, self.records(), self.unhealthy, replacing=replacing)
        gpu = where.index
        extra_env = {**(extra_env or {}), "HF_GPU_UUID": where.uuid} if where.uuid else extra_env
        env = launcher.engine_env(self.settings, spec, engine_id=engine_id, role=role, gpu=gpu, extra=extra_env)
        log_path = self.settings.state_dir / "engines" / f"{engine_id}.log"
        pid = launcher.spawn(spec.command, env, log_path)
        rec = EngineRecord(engine_id=engine_id, model=spec.model, engine_class=spec.engine_class, role=role,
                           gpu=gpu, version=spec.version, spec_key=key, pid=pid, pid_start=proc_start_time(pid),
                           child=True, generation=generation, tp=spec.tp,
                           gang=(gang or engine_id) if spec.tp > 1 else None)
        self.engines[engine_id] = rec
        self.watcher.watch(engine_id, pid, child=True)  # our unreaped child: its pid cannot be recycled yet
        log.info("started %s engine %s (pid %d) for %s on GPU %d", role.value, engine_id, pid, spec.model, gpu)
        self.publish(EngineStarted(engine=self.info(rec)))
        self.save(rec)
        return rec

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

    def _resolve_ready(self, rec: EngineRecord, exc: BaseException | None = None) -> None:
        for fut in self._ready_waiters.pop(rec.engine_id, []):
            if not fut.done():
                if exc is None:
                    fut.set_result(rec)
                else:
                    fut.set_exception(exc)

    # ------------------------------------------------------------ detection

    def fault(self, rec: EngineRecord, kind: FaultKind, *, exit_code: int | None = None, sig: int | None = None,
              detail: str = "", died_at: float | None = None, rank: int | None = None) -> bool:
        """Publish this generation's one FaultDetected; False when it was already published (or a stop)."""
        if not rec.latch_fault():
            return False
        if rec.tp > 1:
            # A TP group is one engine to the outside: a follower's death is seen through its own pidfd where rank 0
            # named it (rank_watch.py) and ends rank 0 anyway (GROUP_DIED, tp_runner.py); the others die with rank 0.
            # So this is the group's one fault, whichever death came first; its incident is the group's.
            detail = f"{detail}; a rank of the group died" if exit_code == GROUP_DIED else detail
        self.publish(FaultDetected(
            engine_id=rec.engine_id, model=rec.model, engine_class=rec.engine_class, generation=rec.generation,
            pid=rec.pid, kind=kind, exit_code=exit_code, signal=sig, gpu=rec.gpu, gpu_uuid=self.uuid_of(rec.gpu),
            died_at=died_at, detail=detail, role=rec.role, node=self.node,
            group=rec.engine_id if rec.tp > 1 else None, gang=rec.gang, rank=rank))
        self.faults_published += 1
        self._tell_shadows(rec)
        rec.transition(Ev.FAULT)
        rec.failed_mono = time.monotonic()
        rec.memory_lost = kind.loses_memory  # no takeover can come for it: its slot is not held (supervision.plan)
        if rec.spec_key is not None:
            delay = self.backoffs.failed(rec.spec_key, rec.failed_mono, rec.failed_mono - rec.spawned_mono)
            if delay > 0:
                log.warning("engines of %s keep failing (%d in a row): the next start waits %.1f s",
                            rec.spec_key, self.backoffs.by_key[rec.spec_key].failures, delay)
        log.warning("engine %s: %s %s", rec.engine_id, kind.value, detail)
        self._resolve_ready(rec, RuntimeError(f"engine {rec.engine_id} failed: {kind.value}"))
        self.save(rec)
        return True

    def _tell_shadows(self, rec: EngineRecord) -> None:
        """A standby shadowing the failed engine hears of it now, not only when assigned (~6 ms later on an H200):
        it can start on the generations the engine had in flight (engines/reference/continuation.py)."""
        for sb in self.engines.values():
            if sb.shadows == rec.engine_id and sb.engine_id in self.links:
                self.background(self.assign(sb, {"op": "owner_down", "owner": rec.engine_id}),
                                f"owner-down:{sb.engine_id}")

    def _on_exit(self, engine_id: str, st: ExitStatus) -> None:
        rec = self.engines.get(engine_id)
        if rec is None:
            return
        rec.exit_code, rec.signal = st.exit_code, st.signal
        if st.known:
            kind, detail = known_fault(st)
        elif rec.said_bye:
            kind, detail = FaultKind.EXITED, "exited after saying goodbye (adopted: exit code unknown)"
        else:
            kind, detail = FaultKind.KILLED, "died without a goodbye (adopted: signal unknown)"
        self.fault(rec, kind, exit_code=st.exit_code, sig=st.signal, detail=detail, died_at=st.at)
        self._gone(rec)

    def exiting(self, engine_id: str, st: ExitStatus) -> None:
        """Seen exiting (PF_EXITING) before the pidfd says dead: the fault is published now. The process can
        no longer run code, but its memory is still mapped until the death: fencing waits for the pidfd."""
        rec = self.engines.get(engine_id)
        if rec is None or not rec.live or rec.said_bye:
            return  # a goodbye before the exit: its own clean stop, reported by the pidfd as usual
        kind, detail = known_fault(st)
        self.fault(rec, kind, exit_code=st.exit_code, sig=st.signal, detail=f"{detail} (seen exiting)", died_at=st.at)

    async def exiting_loop(self) -> None:
        period = self.settings.exit_poll_ms / 1000.0
        while True:
            await asyncio.sleep(period)
            for engine_id, st in self.watcher.poll_exiting():
                self.exiting(engine_id, st)
            for group, rank, st in self.ranks.poll_exiting():
                self._rank_died(group, rank, st, "seen exiting")

    def _gone(self, rec: EngineRecord) -> None:
        """The process no longer exists: drop its link; a stopped engine's record goes away."""
        self.ranks.forget(rec.engine_id)  # a group's rank 0: its followers die with it (PR_SET_PDEATHSIG)
        link = self.links.pop(rec.engine_id, None)
        if link is not None:
            link.close()
        if rec.state is State.STOPPING:
            rec.transition(Ev.GONE)
            self.publish(EngineStopped(engine_id=rec.engine_id, exit_code=rec.exit_code))
            if not rec.handing_over:  # a takeover's predecessor keeps its slot until the takeover retires it
                self.engines.pop(rec.engine_id, None)
                self.writer.delete_engine(self.node, rec.engine_id)
        self._resolve_ready(rec, RuntimeError(f"engine {rec.engine_id} exited"))

    def check_heartbeats(self, now: float, period: float) -> None:
        """Every `period`: the engines silent past their timeout are hung, the agent's own absence not counted
        (a 12 s SIGSTOP of the agent once declared every engine of the node hung the moment it ran again, their
        heartbeats of those 12 s still unread in its sockets)."""
        absent = 0.0 if self._listened_at is None else now - self._listened_at - period
        self._listened_at = now
        if absent > period:  # more than a pass late: this agent was not running
            supervision.credit_absence(self.records(), absent, now)
            if absent > self.settings.heartbeat_timeout_s / 2:
                log.warning("the agent did not run for %.3f s: engines' heartbeat deadlines moved on by as much",
                            absent)
        for rec in supervision.overdue(self.records(), now, self.settings.heartbeat_timeout_s,
                                       self.settings.start_heartbeat_timeout_s):
            late = now - (rec.last_heartbeat or now)
            self.fault(rec, FaultKind.HUNG, detail=f"no heartbeat for {late:.3f}s", died_at=time.time())
        for rec in supervision.never_linked(self.records(), now, self.specs):
            self.fault(rec, FaultKind.HUNG, detail="never connected to the agent", died_at=time.time())

    def gpu_fault(self, gpu: int, detail: str) -> list[str]:
        """A GPU failed (NVML, or marked): it takes no engine until marked healthy; every live engine on it gets its
        one `gpu_fault` (the controller sends its incident to the cold-start fallback: the memory is lost) and is
        killed (it cannot serve from lost memory, and its slot is the fallback's); the gpu_manager is told, so that
        it reclaims the GPU's leases and placement avoids it (`report_gpu`)."""
        self.unhealthy[gpu] = detail or "unhealthy"
        hit = [r for r in self.records() if gpu in r.gpus and r.live]  # a TP group: any rank's GPU
        for rec in hit:
            if self.fault(rec, FaultKind.GPU_FAULT, detail=detail, died_at=time.time()):
                self.background(self._kill_faulted(rec), f"gpu-fault-kill:{rec.engine_id}")
        return [r.engine_id for r in hit]

    def gpu_healthy(self, gpu: int) -> None:
        self.unhealthy.pop(gpu, None)
        self.reconcile_soon()

    async def _kill_faulted(self, rec: EngineRecord) -> None:
        try:
            await self.kill_confirmed(rec)
        except TimeoutError:
            log.error("engine %s on a failed GPU did not die within 5 s of its SIGKILL", rec.engine_id)
        if rec.role is EngineRole.STANDBY:
            self.retire(rec)  # holds no memory: replaced at once (on a healthy GPU)
            self.reconcile_soon()

    async def mark_gpu(self, cmd: MarkGpu) -> MarkGpuReply:
        """The MarkGpu command, and what an NVML fault does (`nvml_fault`)."""
        gpu = resolve_gpu(cmd.gpu, self.gpus)
        engines = self.gpu_fault(gpu.index, cmd.detail) if not cmd.healthy else []
        if cmd.healthy:
            self.gpu_healthy(gpu.index)
        told = await self.report_gpu(gpu.index, cmd.healthy, cmd.detail)
        return MarkGpuReply(gpu=gpu.index, uuid=gpu.uuid, healthy=cmd.healthy, engines=engines, gpu_manager=told)

    def nvml_fault(self, gpu: int, detail: str) -> None:
        """From the NVML thread (through the loop): the faults are published in this call, the gpu_manager told next."""
        if gpu < 0:
            log.error("NVML fault on an unknown device: %s", detail)
            return
        self.gpu_fault(gpu, detail)
        self.gpu_reports.want(gpu, False, detail)

    async def report_gpu(self, gpu: int, healthy: bool, detail: str) -> SetGpuHealthReply | None:
        """Tell the node's gpu_manager, and wait up to REPORT_WAIT_S for its answer; None when it has not answered
        by then (it is told as soon as it is back: gpu_reports.py). The fault stands here anyway."""
        told = self.gpu_reports.want(gpu, healthy, detail)
        try:
            async with asyncio.timeout(REPORT_WAIT_S):
                return await asyncio.shield(told)
        except TimeoutError:
            return None

    async def _send_gpu_health(self, gpu: int, healthy: bool, detail: str) -> SetGpuHealthReply:
        return await self.bus.request(self.node, SetGpuHealth(gpu=gpu, healthy=healthy, detail=detail),
                                      SetGpuHealthReply, timeout=REPORT_WAIT_S)

    # ------------------------------------------------------------ a TP group's followers

    def watch_followers(self, rec: EngineRecord, followers: list[RankProcess]) -> None:
        """Watch a live group's followers through pidfds of the agent's own (rank_watch.py); one already gone is the
        group's fault now. Kept in its record, so that a restarted agent watches them again."""
        if rec.tp <= 1 or not rec.live or not followers:
            return
        watched, gone = self.ranks.watch(rec.engine_id, followers)
        known = {r.rank: r for r in [*followers, *watched]}  # with the start times read as they were watched
        named = [known[r] for r in sorted(known)]
        if named != rec.followers:
            rec.followers = named
            self.save(rec)
        if gone:
            self._rank_died(rec.engine_id, gone[0], None, "gone when the agent came to watch it")

    def _rank_died(self, group: str, rank: RankProcess, st: ExitStatus | None, how: str) -> None:
        """A follower of `group` died: the group's one fault, published now, as for rank 0's death. Rank 0 still runs
        (it exits 70 ~50 ms later, or dies at the takeover's kill); its exit then adds no fault (the latch), and the
        fault's `exit_code` and `signal` stay None (they are rank 0's; the detail names the follower's)."""
        self.ranks.forget(group)  # the first death ends the group's watches (rank_watch.py invariant 3)
        rec = self.engines.get(group)
        if rec is None or not rec.live or rec.said_bye:
            return  # stopping, or a goodbye said: rank 0's own exit is reported by its pidfd as usual
        kind, detail = rank_watch.death_fault(group, rank, st, how)
        self.fault(rec, kind, detail=detail, died_at=st.at if st is not None else time.time(), rank=rank.rank)

    # ------------------------------------------------------------ stopping and killing

    async def kill_confirmed(self, rec: EngineRecord, within_s: float = 5.0) -> ExitStatus | None:
        """SIGKILL through the pidfd and wait for the pidfd to say it is dead (a hung owner still maps memory)."""
        if not self.watcher.watching(rec.engine_id):
            return None  # already dead (or never watched: not a process of this node any more)
        self.watcher.signal(rec.engine_id, signal.SIGKILL)
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
            self._gone(rec)
        return rec.exit_code

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

    # ------------------------------------------------------------ the link with engines

    def on_register(self, msg: dict[str, Any], stream: FrameStream) -> EngineRecord:
        creds = stream.peer_credentials()
        pid = int(msg.get("pid") or 0)
        if pid != creds.pid:
            raise PermissionDenied(f"claimed pid {pid} but the socket says {creds.pid}")
        engine_id = str(msg.get("engine_id") or "")
        if not engine_id:
            raise PermissionDenied("register needs an engine_id")
        rec = self.engines.get(engine_id)
        if rec is not None and rec.pid not in (None, pid) and self.watcher.watching(engine_id):
            raise Conflict(f"engine {engine_id} is already registered by pid {rec.pid}")
        if rec is not None and rec.state is State.FAILED and rec.pid == pid:
            # Declared failed (hung, say, slow to connect): its fault is published and its slot is a successor's;
            # adopting it again would run one engine more than the spec wants. It is killed when retired.
            raise Conflict(f"engine {engine_id} (pid {pid}) was declared failed: it is replaced, not registered")
        if rec is None or not rec.live:
            rec = self._adopt(msg, pid)
        old = self.links.pop(engine_id, None)
        if old is not None and old is not stream:
            old.close()  # the same engine registering again: its newer connection wins
        self.links[engine_id] = stream
        rec.linked = True
        if msg.get("heartbeats") and rec.last_heartbeat is None:
            rec.last_heartbeat = time.monotonic()  # re-registration of a heartbeating engine: keep watching
        rec.can_shadow = bool(msg.get("can_shadow"))
        rec.fences = bool(msg.get("fences"))
        if msg.get("followers") and rec.tp > 1:  # a TP group's rank 0 names its other ranks: watched from now on
            try:
                self.watch_followers(rec, rank_watch.parse_followers(msg["followers"], rec.tp))
            except MalformedMessage as e:
                log.warning("engine %s: %s; its followers' deaths are seen through its exit", rec.engine_id, e)
        if msg.get("shadows"):
            rec.shadows = str(msg["shadows"])  # re-registration: it still shadows that engine
        state = msg.get("state")
        if state in ("ready", "standby") and rec.state is State.STARTING:
            rec.endpoint = msg.get("endpoint")
            rec.transition(Ev.READY)
            self.save(rec)
        return rec

    def _adopt(self, msg: dict[str, Any], pid: int) -> EngineRecord:
        """An engine this agent does not know (a previous agent's child whose record it never wrote, or one started
        by someone else): adopted into its spec, if that spec has room for it (supervision.admit_stranger), else
        refused with a `conflict` and ended, so that it never runs beside the replacement that took its slot."""
        role = EngineRole(msg.get("role") or "active")
        model, engine_class = str(msg.get("model") or "unknown"), str(msg.get("engine_class") or "default")
        version = str(msg.get("version") or "1")
        key = supervision.stranger_key(self.specs, model, engine_class, version)
        why = supervision.admit_stranger(self.specs, self.records(), key, role)
        if why is not None:
            self._end_refused(pid)
            raise Conflict(f"engine {msg['engine_id']} (pid {pid}) is one too many: {why}")
        start = proc_start_time(pid)
        # a TP group's rank 0 names its followers: the group's size is its spec's, else theirs and its own (checked
        # against each other as they are watched, register below)
        followers = msg.get("followers")
        spec = self.specs.get(key) if key is not None else None
        tp = spec.tp if spec is not None else (len(followers) + 1 if isinstance(followers, list) and followers else 1)
        rec = EngineRecord(engine_id=str(msg["engine_id"]), model=model, engine_class=engine_class, role=role,
                           gpu=int(msg.get("gpu") or 0), version=version, spec_key=key, pid=pid,
                           pid_start=start, child=False, tp=tp)
        self.watcher.watch(rec.engine_id, pid, child=False, start_time=start)
        self.engines[rec.engine_id] = rec
        log.info("adopted engine %s (pid %d) started by someone else%s", rec.engine_id, pid,
                 f", into {key}" if key is not None else "")
        self.publish(EngineStarted(engine=self.info(rec)))
        self.save(rec)
        return rec

    def _end_refused(self, pid: int) -> None:
        """End a refused stranger (not our child, so nobody else will): SIGTERM through a pidfd opened now, while
        its registration is in hand (SO_PEERCRED's pid), SIGKILL after `stop_timeout_s`. An engine exits on a
        refused first registration by itself; one refused when it registers again (its link reconnecting after
        our restart, libs/client/agent_link.py) would retry for ever."""
        if pid in self._ending:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        self._ending.add(pid)
        self.background(self._ended(pid, fd), f"end-refused:{pid}")

    async def _ended(self, pid: int, fd: int) -> None:
        try:
            if await end_process(fd, self.settings.stop_timeout_s):
                log.info("refused engine (pid %d) exited", pid)
            else:
                log.error("refused engine (pid %d) could not be ended (another uid's, or it outlived a SIGKILL)", pid)
        finally:
            self._ending.discard(pid)

    def on_message(self, rec: EngineRecord, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Handle one frame from an engine; returns the reply (an ack) if the frame wants one."""
        op = msg.get("op")
        if op == "heartbeat":
            armed = rec.last_heartbeat is not None
            rec.last_heartbeat = time.monotonic()
            if not armed:
                self.save(rec)  # recorded, so that a restarted agent keeps watching it for hangs
            return None
        ack = {"op": "ack", "seq": msg.get("seq")} if "seq" in msg else None
        if op == "ready":
            if msg.get("heartbeats") and rec.last_heartbeat is None:
                rec.last_heartbeat = time.monotonic()  # heartbeats are on: a hang from now on is detected
            rec.endpoint = msg.get("endpoint")
            kv = msg.get("kv")
            rec.kv = kv[:500] if isinstance(kv, str) else None
            try:
                rec.weights = weights_loaded(msg.get("weights"))
            except MalformedMessage as e:  # the engine serves all the same; its timeline lacks the source
                log.warning("engine %s: %s", rec.engine_id, e)
            if rec.state in (State.STARTING, State.ASSIGNED, State.READY, State.STANDBY):
                rec.ready_perf = time.perf_counter()
                rec.transition(Ev.READY)
                # The waiter (a takeover's reply) first: it runs before the publish and the etcd write
                # queued below (the event loop runs callbacks in the order they were scheduled).
                self._resolve_ready(rec)
                self.publish(EngineReady(engine=self.info(rec), takeover_of=rec.taking_over))
                self.save(rec)
                self.reconcile_soon()  # a new standby, or a new engine to shadow
        elif op == "fatal":
            kind = FaultKind.CUDA_ERROR if msg.get("kind", "cuda_error") == "cuda_error" else FaultKind(msg["kind"])
            self.fault(rec, kind, detail=str(msg.get("detail", "")), died_at=time.time())
        elif op == "shadowing":
            shadows.shadowing(self, rec, msg.get("owner") or None)
        elif op == "asleep":  # its memory goes (or came back): its shadows are dropped (or offered again)
            rec.asleep = bool(msg.get("sleeping"))
            self.background(shadows.reconcile(self), f"shadows:{rec.engine_id}")
        elif op == "bye":
            rec.said_bye = True
        else:
            return {"op": "error", "code": "malformed", "message": f"unknown op {op!r}"}
        return ack

    def on_link_closed(self, rec: EngineRecord, stream: FrameStream) -> None:
        if self.links.get(rec.engine_id) is stream:
            self.links.pop(rec.engine_id, None)
            rec.linked = False

    async def assign(self, rec: EngineRecord, msg: dict[str, Any]) -> None:
        link = self.links.get(rec.engine_id)
        if link is None:
            raise ConnectionError(f"standby {rec.engine_id} has no link")
        await link.send(msg)

    def memory_gone(self, rec: EngineRecord, why: str) -> None:
        """No takeover will come for this failed engine's memory (its incident has ended): it is replaced now
        rather than at the end of `takeover_wait_s`."""
        if rec.memory_lost or rec.state is not State.FAILED:
            return
        rec.memory_lost = True
        log.info("engine %s: %s; no takeover will come: replaced now", rec.engine_id, why)
        self.reconcile_soon()

    # ------------------------------------------------------------ re-adoption after an agent restart

    def readopt(self, info: EngineInfo) -> None:
        rec = EngineRecord.from_info(info)
        if rec.state in (State.STOPPED, State.STOPPING) or rec.pid is None:
            self.writer.delete_engine(self.node, rec.engine_id)
            return
        self.engines[rec.engine_id] = rec
        try:
            self.watcher.watch(rec.engine_id, rec.pid, child=False, start_time=rec.pid_start)
        except ProcessLookupError:
            log.warning("engine %s (pid %s) died while the agent was away", rec.engine_id, rec.pid)
            self.fault(rec, FaultKind.KILLED, detail="died while the agent was away (status unknown)",
                       died_at=time.time())
            rec.failed_mono = time.monotonic()  # a takeover may still come for an active engine's memory
            if rec.role is EngineRole.STANDBY:
                self.retire(rec)
            return
        if rec.state is State.FAILED:
            rec.failed_mono = time.monotonic()  # restart the takeover wait: nobody counted it while we were down
        # A group's followers, from its record (and again from rank 0's registration when its link reconnects). A
        # record without them (written by an older agent, or rank 0 never named them) leaves a follower's death to
        # rank 0's exit 70, as before this was built.
        self.watch_followers(rec, rec.followers)
        log.info("re-adopted engine %s (pid %d, %s)", rec.engine_id, rec.pid, rec.state.value)

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
        p = supervision.plan(self.specs, self.records(), now, self.settings.takeover_wait_s, self.backoffs)
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
            except (OSError, ValueError, HoldfastError) as e:
                log.error("cannot start a %s engine of %s: %s", role.value, key, e)
        await shadows.reconcile(self)

    async def probe_loop(self) -> None:
        """Every `probe_interval_s`, GET /health of each serving engine: `probe_failures` rounds in a row without an
        answer within `probe_timeout_s` is a hang of its server (a gray failure: its heartbeats, from a thread of
        their own, go on; the router meanwhile waits `token_timeout_s` per request on it). A round in which the
        agent itself was not running (its sleep or its probes far later than asked) counts for nobody."""
        import httpx

        s = self.settings
        if s.probe_interval_s <= 0:
            return
        failures: dict[str, int] = {}
        async with httpx.AsyncClient(timeout=s.probe_timeout_s, trust_env=False) as client:
            while True:
                t0 = time.monotonic()
                await asyncio.sleep(s.probe_interval_s)
                targets = supervision.probe_targets(self.records())
                t1 = time.monotonic()
                results = await asyncio.gather(*(self._answers(client, r.endpoint or "") for r in targets))
                late = (t1 - t0 - s.probe_interval_s) + max(0.0, time.monotonic() - t1 - s.probe_timeout_s)
                if late > min(s.probe_interval_s, s.probe_timeout_s) / 2:
                    continue  # the agent was away: a timeout this round may be its own
                answered = {r.engine_id: ok for r, ok in zip(targets, results, strict=True)}
                for engine_id in supervision.count_probes(failures, answered, s.probe_failures):
                    rec = self.engines.get(engine_id)
                    if rec is not None and rec in targets and not rec.faulted:
                        self.fault(rec, FaultKind.HUNG, died_at=time.time(),
                                   detail=f"its HTTP server answered no GET /health in {s.probe_failures} probes "
                                          f"({s.probe_timeout_s:g} s each); heartbeats went on")

    @staticmethod
    async def _answers(client: Any, endpoint: str) -> bool:
        """Whether the server at `endpoint` answers at all (any status: its loop runs)."""
        import httpx

        try:
            await client.get(f"{endpoint}/health")
        except httpx.HTTPError:
            return False
        return True

    async def monitor_loop(self) -> None:
        """Heartbeat deadlines, checked often enough that a hang is seen within timeout + 1/10 of it."""
        period = max(0.01, min(0.1, self.settings.heartbeat_timeout_s / 10))
        while True:
            await asyncio.sleep(period)
            self.check_heartbeats(time.monotonic(), period)

    async def close(self) -> None:
        for link in list(self.links.values()):
            link.close()
        self.watcher.close()
        self.ranks.close()
        self.gpu_reports.close()
        for task in list(self._tasks):
            task.cancel()
