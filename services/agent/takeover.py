"""Takeover: a successor engine gets a failed (or to-be-replaced) engine's memory.

Order matters for safety (DESIGN.md section 3, fencing): a predecessor that is still alive (hung, or
healthy in a manual failover or hot upgrade) may still have the memory mapped, so it is SIGKILLed and its
death confirmed through its pidfd before the successor receives the assignment.

Except for two kinds of standby, assigned as soon as the kill is sent, their predecessor's death confirmed later,
off the serving path (on a death the agent saw coming this saves the ~75-95 ms of a CUDA process's teardown):
- one that fences itself (the batched engine): it asks the gpu_manager for a fenced takeover, granted once the
  predecessor can run no code, maps the leases during the predecessor's teardown and reads or writes them only
  after its exit (its pidfd);
- one that shadows the predecessor (shadows.py): it already maps the predecessor's weights read-only and has
  its own KV cache, so the two never write the same memory; it serves at once and owns the leases (read-write)
  only once the gpu_manager has seen the predecessor dead, which the standby waits for by itself.

Then: a ready standby of the model (the named one, or the oldest) gets `assign` over its link, takes the
leases over and says ready. None warm but one still starting (the refill after an earlier takeover, when a second
failure comes soon after the first): it is waited for, up to its spec's cold start, and then assigned; its start is
under way, so it is warm no later than a process spawned now, and no second process competes with it meanwhile
(single engines; a group cold-spawns). A standby that dies or does not get ready in time, or no standby at all: a
new process is cold-spawned with HF_TAKEOVER_FROM / HF_TRANSFER_TOKEN and reattaches the same way.

A tensor-parallel group (`gang`): its rank 0 is killed and its death confirmed (the other ranks die with it; the
gpu_manager moves nothing while any rank of the old group runs); then a ready standby group of the same shape (as
many ranks, on the same GPUs) is assigned the gang, or, none ready (or it fails), a new group is cold-spawned. Either
way the successor group is told the same orders (`_orders`: the assignment's fields, or HF_TAKEOVER_GANG,
HF_GANG_GENERATION, HF_TRANSFER_TOKEN), and each of its ranks takes its own rank's leases of the frozen gang over,
all or none (engines/batched/tp_group.py `RankGroup.load`).

`memory_of`: the leases taken over are that engine's, not the predecessor's (a shadow promoted early that died
before it owned its own predecessor's leases: they are still frozen, and the dc_manager hands them on).

Idempotent by incident id: a repeated command awaits (or returns) the first one's result. Across a restart of this
agent too: a standby its previous life assigned says so as it registers again (its link repeats the assignment), and
its record, re-adopted from etcd and written before the assignment, follows it (`supervision.inherit_assignment`:
active, assigned or ready); the takeover is resumed under the incident's id (`resume`): it waits for that standby's
"ready" and answers as the first one would have (the event, the records, the predecessor retired), and the control
plane's re-sent takeover joins it. Before this, the standby was taken for a standby still, assigned again, said
nothing, was declared hung after `takeover_timeout_s` and killed, the memory it held frozen for a second incident that
failed (probe D2-frozen, 2026-12-07: 24-28 s without service). A command that comes in this agent's first moments
waits until the engines of its previous life have registered again (`starts_from`), so that it finds such a standby
resumed rather than choosing it. A resumed successor that dies or is not ready in time gives way (`GaveWay`): the
command runs the takeover from the start.

Promoted here (`promote`, setting `promote_locally`, off by default: the agent's README says why): an active single
engine that died (killed or exited, seen exiting or dead: no fault of its GPU, which this agent holds sound) with a
ready standby beside it that shadows it and fences itself. The agent does not wait for the control plane (the
fault's way to the controller, its intent to the dc_manager, the dc_manager's freeze and takeover: ~4-5 ms on an
H100, 10-20 ms on a 2-core VM): under a token of its own it asks its node's gpu_manager to freeze the engine's
leases for the incident's own id (`incident_id("inc", engine, generation)`, the one the controller opens for that
fault; `Freeze.promotion`: its token replaces that of a freeze of the same incident that came first, which nobody
holds), then runs the takeover above as if that command had come, with the token the freeze answered. The takeover
is registered under the incident's id before the fault leaves this agent, so the control plane's takeover joins it;
the control plane's freeze finds the leases frozen under this token, or handed on already
(`FreezeReply.handed_to`). A freeze that fails (the manager unreachable after a few tries, nothing to hand on)
promotes nobody: the promotion gives way (`PromotionDropped`) and the control plane's takeover, joined or still to
come, runs as it would have.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import time
from typing import Any, Protocol

from libs.common.bus import retried_unanswered
from libs.common.errors import Conflict, HoldfastError, NotFound
from libs.common.events import (
    EngineReattached,
    EngineRole,
    EngineSpec,
    FaultKind,
    Freeze,
    FreezeReply,
    Takeover,
    TakeoverReply,
)
from libs.common.ids import incident_id
from libs.common.procs import ms_since
from services.agent import supervision
from services.agent.engines import EngineRecord, Ev, State
from services.agent.pidfd import ExitStatus
from services.agent.records import RecordWriter
from services.agent.starts import Starts
from services.agent.table import EngineTable, FaultReporter

log = logging.getLogger("holdfast.agent.takeover")
# a successor's orders (`Takeovers._orders`) as a cold successor's environment
ORDER_ENV = {"transfer_token": "HF_TRANSFER_TOKEN", "incident_id": "HF_INCIDENT_ID", "takeover_from": "HF_TAKEOVER_FROM",
             "gang": "HF_TAKEOVER_GANG", "gang_generation": "HF_GANG_GENERATION"}



class Host(EngineTable, FaultReporter, Protocol):
    """What a takeover needs of the agent beyond its engine table and faulting: admission (`starts`), the record
    writer (a hot upgrade's specs), an engine by id, its kill confirmed, its retirement, a standby's assignment and
    an engine's "ready", a cold successor's start, and a reconcile pass (the replacement standby)."""

    starts: Starts
    writer: RecordWriter
    starts_from: float  # monotonic: until then engines of this agent's previous life register again

    def get(self, engine_id: str) -> EngineRecord: ...

    async def kill_confirmed(self, rec: EngineRecord, within_s: float = 5.0) -> ExitStatus | None: ...

    def retire(self, rec: EngineRecord) -> None: ...

    async def assign(self, rec: EngineRecord, msg: dict[str, Any]) -> None: ...

    async def wait_ready(self, engine_id: str, within_s: float) -> EngineRecord: ...

    def start_engine(self, key: str, role: EngineRole, *, engine_id: str | None = None, generation: int = 0,
                     extra_env: dict[str, str] | None = None, spec: EngineSpec | None = None,
                     replacing: EngineRecord | None = None, gang: str | None = None) -> EngineRecord: ...

    def reconcile_soon(self) -> None: ...

    def gpu_sound(self, gpu: int) -> bool: ...

    async def freeze(self, cmd: Freeze) -> FreezeReply: ...


PROMOTED_KINDS = frozenset({FaultKind.KILLED, FaultKind.EXITED})  # a process's own death: its GPU and memory intact
LOCAL_FREEZE_TRIES = 3  # the agent's own freeze, sent again while unanswered (each try waits LOCAL_FREEZE_S)


class GaveWay(Exception):
    """A takeover this agent began by itself (its own promotion, or one resumed after its restart) gave way: a command
    for its incident runs the takeover from the start."""


class PromotionDropped(GaveWay):
    """The agent's own promotion gave way before it assigned anyone (its freeze failed)."""


def why_not_promoted(pred: EngineRecord, kind: FaultKind, standby: EngineRecord | None, *,
                     gpu_sound: bool) -> str | None:
    """Why the agent leaves this death to the control plane, or None: it takes the engine over itself (the module's
    docstring). Pure."""
    if kind not in PROMOTED_KINDS:
        return f"a {kind.value} fault"
    if pred.role is not EngineRole.ACTIVE or pred.tp > 1 or pred.gang is not None:
        return "not an active single engine"
    if pred.handing_over:
        return "a takeover of it is under way"
    if not gpu_sound:
        return f"its GPU {pred.gpu} is not sound"
    if standby is None or standby.state is not State.STANDBY or standby.shadows != pred.engine_id or not standby.fences:
        return "no ready standby shadows it and fences itself"
    return None


class Takeovers:
    def __init__(self, host: Host) -> None:
        self.host = host
        self._by_incident: dict[str, asyncio.Task[TakeoverReply]] = {}
        self._cold_specs: dict[str, EngineSpec] = {}  # hot upgrades cold-spawned from a version not configured
        self.promoted = 0  # promotions this agent began itself (`promote`)

    async def handle(self, cmd: Takeover) -> TakeoverReply:
        await self._settled()
        while True:
            task = self._by_incident.get(cmd.incident_id)
            if task is None:
                self.host.get(cmd.engine_id)  # NotFound before anything is remembered
                task = asyncio.get_running_loop().create_task(self._run(cmd), name=f"takeover:{cmd.incident_id}")
                self._by_incident[cmd.incident_id] = task
            try:
                # shield: a caller that times out must not cancel the takeover other callers (and the memory) wait on
                return await asyncio.shield(task)
            except GaveWay:
                continue  # this agent's own promotion, or a resumed takeover, gave way: this command runs it

    async def _settled(self) -> None:
        """In this agent's first moments (`starts_from`), engines of its previous life register again (every 50 ms):
        a standby it had assigned resumes its takeover as it does (`resume`), and a command waits for that rather
        than choosing it again as if it stood by."""
        wait = self.host.starts_from - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)

    def resume(self, successor: EngineRecord) -> None:
        """`successor` registered assigned by this agent's previous life (`supervision.inherit_assignment`): its
        takeover resumed under its incident's id, which the control plane's re-sent takeover joins (the module's
        docstring)."""
        inc = successor.assigned_for
        if inc is None or inc in self._by_incident:
            return
        task = asyncio.get_running_loop().create_task(self._resumed(inc, successor), name=f"resume:{inc}")
        task.add_done_callback(_retrieved)  # nobody may join it: its failure is logged
        self._by_incident[inc] = task

    async def _resumed(self, inc: str, successor: EngineRecord) -> TakeoverReply:
        """The rest of a takeover this agent's previous life began: its predecessor killed (again) and retired once
        dead, the successor's "ready" waited for, the answer as `_run` gives it."""
        host = self.host
        t0 = time.perf_counter()
        pred = host.engines.get(successor.taking_over or "")
        if pred is not None:
            pred.handing_over = True
            successor.generation = pred.generation + 1
            if host.watcher.watching(pred.engine_id):  # it was being killed as the previous life died
                if pred.state is not State.FAILED:
                    pred.transition(Ev.STOP)  # a planned replacement, not a fault
                host.watcher.signal(pred.engine_id, signal.SIGKILL)  # confirmed, and retired, by `_finish`
        try:
            await host.wait_ready(successor.engine_id, host.settings.takeover_timeout_s)
        except (RuntimeError, TimeoutError) as e:
            log.warning("takeover %s: %s, assigned before this agent's restart, failed (%s); a command runs it again",
                        inc, successor.engine_id, e or "timed out")
            if successor.live:
                host.fault(successor, FaultKind.HUNG, detail=f"failed during takeover: {e}", died_at=time.time())
            await host.kill_confirmed(successor)
            host.retire(successor)
            if pred is not None:
                pred.handing_over = False  # nobody took its slot (yet): the reconciler may replace it
                if pred.state is State.STOPPED:
                    host.retire(pred)
            self._by_incident.pop(inc, None)
            raise GaveWay(str(e)) from e
        successor.shadows = None  # it serves now; what it shadowed is its own
        timings = {"resumed": 1.0, "attach_ready_ms": ms_since(t0)}
        return self._finish(inc, pred, successor.taking_over or "", successor, used_standby=True, timings=timings,
                            t0=t0, version=successor.version)

    def promote(self, pred: EngineRecord, kind: FaultKind) -> bool:
        """Take `pred`, dead of `kind`, over now, without waiting for the control plane (the module's docstring);
        False when it is left to the control plane."""
        if not self.host.settings.promote_locally:
            return False
        inc = incident_id("inc", pred.engine_id, pred.generation)  # the controller's for this fault (incident.py)
        if inc in self._by_incident:
            return False
        standby = supervision.pick_standby(self.host.records(), pred.model, predecessor=pred.engine_id, gpu=pred.gpu)
        why = why_not_promoted(pred, kind, standby, gpu_sound=self.host.gpu_sound(pred.gpu))
        if why is not None:
            log.debug("engine %s: not promoting a standby here (%s)", pred.engine_id, why)
            return False
        cmd = Takeover(incident_id=inc, engine_id=pred.engine_id, transfer_token=secrets.token_urlsafe(24))
        task = asyncio.get_running_loop().create_task(self._promote(cmd), name=f"promote:{inc}")
        task.add_done_callback(_retrieved)  # a promotion nobody joins: its failure is logged by `_run`
        self._by_incident[inc] = task
        self.promoted += 1
        return True

    async def _promote(self, cmd: Takeover) -> TakeoverReply:
        """The leases frozen (sent again while the manager does not answer), then the takeover with the token the
        freeze answered; a freeze that fails gives way to the control plane (the module's docstring)."""
        t = time.perf_counter()
        freeze = Freeze(owner=cmd.engine_id, incident_id=cmd.incident_id, transfer_token=cmd.transfer_token,
                        promotion=True)
        try:
            got = await retried_unanswered(lambda: self.host.freeze(freeze), LOCAL_FREEZE_TRIES, 0.05)
            if got.handed_to is not None:
                raise Conflict(f"its leases were handed to {got.handed_to} already")
        except HoldfastError as e:
            log.warning("takeover %s: this agent's freeze of %s failed (%s): left to the control plane",
                        cmd.incident_id, cmd.engine_id, e)
            self._by_incident.pop(cmd.incident_id, None)
            raise PromotionDropped(str(e)) from e
        freeze_ms = ms_since(t)
        log.info("takeover %s: %s frozen here in %.2f ms", cmd.incident_id, cmd.engine_id, freeze_ms)
        return await self._run(cmd.model_copy(update={"transfer_token": got.transfer_token}),
                               {"promoted_here": 1.0, "local_freeze_ms": freeze_ms})

    async def _run(self, cmd: Takeover, timings: dict[str, float] | None = None) -> TakeoverReply:
        host = self.host
        t0 = time.perf_counter()
        timings = dict(timings or {})
        pred = host.get(cmd.engine_id)
        # The memory's owner: the predecessor, or (memory_of) its own predecessor, whose frozen leases it died
        # before owning. A shadow of the predecessor maps those only if it is the owner.
        owner = cmd.memory_of or pred.engine_id
        orders = self._orders(cmd, owner)  # a gang takeover without its generation is refused before any fencing
        standby = self._choose(cmd, pred, owner)  # a TP group's: a standby group of its shape
        # None warm: a standby still starting (a refill after an earlier takeover) is waited for, not doubled
        starting = (supervision.starting_standby(host.records(), pred.model, version=cmd.version, gpu=pred.gpu)
                    if standby is None and cmd.successor is None and pred.tp == 1 else None)
        # Refused before anyone is fenced when the spec already runs its count without the predecessor (another
        # incident's successor, or a cold start, took the slot); checked again where the successor becomes active.
        host.starts.admit_active(pred.spec_key or "", replacing=pred, candidate=standby.engine_id if standby else None)
        shadowed = standby is not None and standby.state is State.STANDBY and standby.shadows == owner
        # A standby that fences itself (a fenced takeover: granted once the predecessor is stopped, touching nothing
        # before its exit) needs no confirmed death either: the gpu_manager and the standby hold the fence.
        fenced = standby is not None and standby.state is State.STANDBY and standby.fences

        # 1. Fence: a live predecessor dies (confirmed) before anyone else gets its memory read-write.
        t = time.perf_counter()
        mem_owner = host.engines.get(owner) if owner != pred.engine_id else None
        if mem_owner is not None:  # memory_of: the memory's owner died first; its exit is confirmed too (the
            await host.kill_confirmed(mem_owner)  # gpu_manager refuses a takeover while its process still exits)
        pred.handing_over = True
        if host.watcher.watching(pred.engine_id):
            if pred.state is not State.FAILED:
                pred.transition(Ev.STOP)  # a planned replacement, not a fault
            if shadowed or fenced:
                host.watcher.signal(pred.engine_id, signal.SIGKILL)  # confirmed later, off the serving path
            else:
                await host.kill_confirmed(pred)
        timings["kill_ms"] = ms_since(t)

        successor: EngineRecord | None = None
        used_standby = False
        try:
            if starting is not None:
                standby = await self._warmed(cmd, pred, starting, timings)
            if standby is not None and standby.state is State.STANDBY:
                successor = await self._via_standby(cmd, pred, owner, standby, timings, shadowed, orders)
                used_standby = successor is not None
            if successor is None:
                await host.kill_confirmed(pred)  # a cold successor maps the memory read-write
                successor = await self._cold(cmd, pred, owner, timings)
        except BaseException:
            pred.handing_over = False  # nobody took its slot: the reconciler may replace it
            if pred.state is State.STOPPED:
                host.retire(pred)
            raise

        if cmd.gang is not None:
            successor.gang = cmd.gang  # the gang keeps its id across groups
        timings["shadowed"] = float(shadowed and used_standby)
        timings["fenced"] = float(fenced and used_standby)
        return self._finish(cmd.incident_id, pred, owner, successor, used_standby=used_standby, timings=timings,
                            t0=t0, version=cmd.version)

    def _finish(self, inc: str, pred: EngineRecord | None, owner: str, successor: EngineRecord, *,
                used_standby: bool, timings: dict[str, float], t0: float, version: str | None) -> TakeoverReply:
        """A successor ready: the event, its record, the predecessor retired (once dead), a hot upgrade's desired
        counts moved, the replacement standby soon; the reply."""
        host = self.host
        successor.successor_of = owner
        if successor.ready_perf is not None and successor.ready_perf >= t0:
            timings["ready_to_reply_ms"] = ms_since(successor.ready_perf)  # the agent's own lag after "ready"
        timings["total_ms"] = ms_since(t0)
        info = host.info(successor)
        # The event first, the bookkeeping after: the etcd writes queued below then run behind the publish.
        host.publish(EngineReattached(incident_id=inc, predecessor_id=pred.engine_id if pred is not None else owner,
                                      engine=info, used_standby=used_standby, timings_ms=timings))
        host.save(successor)  # its record names whose memory it holds (`successor_of`), cold or warm
        if pred is not None and pred.engine_id in host.engines:
            if host.watcher.watching(pred.engine_id):
                host.background(self._retire_when_dead(pred), f"retire:{pred.engine_id}")
            else:
                host.retire(pred)
        if pred is not None and version is not None and successor.spec_key not in (None, pred.spec_key):
            self._move_replica(pred, successor)
        log.info("takeover %s: %s -> %s (%s) in %.1f ms %s", inc, pred.engine_id if pred is not None else owner,
                 successor.engine_id, "standby" if used_standby else "cold spawn", timings["total_ms"], timings)
        # A replacement standby, in the background, once the reply is out: spawning it takes the agent's loop
        # for a while and the new process competes for CPU with the successor's first requests.
        asyncio.get_running_loop().call_later(host.settings.standby_refill_delay_s, host.reconcile_soon)
        return TakeoverReply(engine=info, used_standby=used_standby, timings_ms=timings)

    async def _retire_when_dead(self, pred: EngineRecord) -> None:
        try:
            await self.host.kill_confirmed(pred, within_s=30.0)
        except TimeoutError:
            log.error("predecessor %s (pid %s) survived SIGKILL for 30 s; the reconciler retries", pred.engine_id,
                      pred.pid)
            return
        self.host.retire(pred)

    def _move_replica(self, pred: EngineRecord, successor: EngineRecord) -> None:
        """Hot upgrade: the desired replica moves to the new version's spec (else the old one restarts)."""
        host = self.host
        old = host.specs.get(pred.spec_key or "")
        new = host.specs.get(successor.spec_key or "") or self._cold_specs.get(successor.spec_key or "")
        if old is None or new is None:
            return  # adopted engines: nobody's desired state to update
        old, new = supervision.move_replica(old, new)
        for key, spec in ((pred.spec_key or "", old), (successor.spec_key or "", new)):
            host.specs[key] = spec
            host.writer.put_spec(host.node, key, spec)
        log.info("hot upgrade: %s now wants %d, %s %d", pred.spec_key, old.replicas, successor.spec_key, new.replicas)

    def _choose(self, cmd: Takeover, pred: EngineRecord, owner: str) -> EngineRecord | None:
        records = self.host.records()
        # a group's successor is a group on the same GPUs
        if cmd.successor is None:
            return supervision.pick_standby(records, pred.model, version=cmd.version, predecessor=owner, tp=pred.tp,
                                            gpu=pred.gpu)
        named = self.host.engines.get(cmd.successor)
        if named is None:
            raise NotFound(f"no successor engine {cmd.successor!r} on node {self.host.node}")
        fit = supervision.pick_standby(records, pred.model, version=cmd.version, named=cmd.successor, tp=pred.tp,
                                       gpu=pred.gpu)
        if fit is None:
            raise Conflict(f"engine {cmd.successor} is not a ready standby for {pred.model} ({named.state.value})")
        return fit

    async def _warmed(self, cmd: Takeover, pred: EngineRecord, sb: EngineRecord,
                      timings: dict[str, float]) -> EngineRecord | None:
        """`sb` (a standby still starting: `supervision.starting_standby`) once it is warm; None when it died, was
        not warm within its spec's cold start, or another takeover took it meanwhile: the caller cold-spawns. Its
        start is under way, so it is warm no later than a process spawned now would be (and no second one competes
        with it for the CPU and the GPU meanwhile)."""
        host = self.host
        spec = host.specs.get(pred.spec_key or "")
        t = time.perf_counter()
        try:
            await host.wait_ready(sb.engine_id, spec.cold_start_s if spec else host.settings.takeover_timeout_s)
        except (RuntimeError, TimeoutError) as e:
            log.warning("takeover %s: standby %s did not get warm (%s); cold-spawning instead", cmd.incident_id,
                        sb.engine_id, e or "timed out")
            return None
        finally:
            timings["standby_warm_wait_ms"] = ms_since(t)
        still = supervision.pick_standby(host.records(), pred.model, version=cmd.version, named=sb.engine_id,
                                         gpu=pred.gpu)
        if still is None:  # no longer a warm standby of that shape: assigned by another takeover meanwhile
            log.info("takeover %s: standby %s was taken by another takeover while warming; cold-spawning instead",
                     cmd.incident_id, sb.engine_id)
            return None
        return sb

    async def _via_standby(self, cmd: Takeover, pred: EngineRecord, owner: str, sb: EngineRecord,
                           timings: dict[str, float], shadowed: bool, orders: dict[str, str]) -> EngineRecord | None:
        host = self.host
        t = time.perf_counter()
        host.starts.admit_active(sb.spec_key or "", replacing=pred, candidate=sb.engine_id)
        sb.transition(Ev.ASSIGN)
        sb.taking_over, sb.assigned_for = owner, cmd.incident_id
        sb.role = EngineRole.ACTIVE
        sb.generation = pred.generation + 1
        try:
            await host.assign(sb, {"op": "assign", "predecessor": owner, "model": pred.model, "shadowed": shadowed,
                                   **orders})
            timings["assign_ms"] = ms_since(t)
            # sent (the kernel has it): what a restarted agent finds the standby saying as it registers again
            log.info("takeover %s: standby %s assigned", cmd.incident_id, sb.engine_id)
            t = time.perf_counter()
            await host.wait_ready(sb.engine_id, host.settings.takeover_timeout_s)
            timings["attach_ready_ms"] = ms_since(t)
            sb.shadows = None  # it serves now; what it shadowed is its own
            return sb
        except (ConnectionError, OSError, RuntimeError, TimeoutError) as e:
            log.warning("standby %s failed during takeover %s (%s); cold-spawning instead",
                        sb.engine_id, cmd.incident_id, e)
            timings["standby_failed_ms"] = ms_since(t)
            if sb.live:
                host.fault(sb, FaultKind.HUNG, detail=f"failed during takeover: {e}", died_at=time.time())
            await host.kill_confirmed(sb)
            host.retire(sb)
            return None

    @staticmethod
    def _orders(cmd: Takeover, owner: str) -> dict[str, str]:
        """What a successor is told, standby (its `assign`) or cold (its environment, `_takeover_env`): the owner's
        frozen leases, or (a TP group) the whole frozen gang, each rank its own rank's leases
        (engines/batched/tp_group.py, engines/reference/tp_runner.py)."""
        orders = {"transfer_token": cmd.transfer_token, "incident_id": cmd.incident_id}
        if cmd.gang is None:
            return {**orders, "takeover_from": owner}
        if cmd.gang_generation is None:
            raise Conflict(f"takeover of gang {cmd.gang} without its generation (FreezeGang's reply names it)")
        return {**orders, "gang": cmd.gang, "gang_generation": str(cmd.gang_generation)}

    @staticmethod
    def _takeover_env(cmd: Takeover, owner: str) -> dict[str, str]:
        """A cold successor's orders, as the environment it reads."""
        return {ORDER_ENV[k]: v for k, v in Takeovers._orders(cmd, owner).items()}

    async def _cold(self, cmd: Takeover, pred: EngineRecord, owner: str, timings: dict[str, float]) -> EngineRecord:
        host = self.host
        spec = host.specs.get(pred.spec_key or "")
        if spec is None:
            raise Conflict(f"no ready standby for {pred.model} and no spec to cold-spawn {pred.engine_id} from")
        if cmd.version is not None and cmd.version != spec.version:
            spec = spec.model_copy(update={"version": cmd.version, "replicas": 0})
            self._cold_specs[supervision.spec_key(spec)] = spec
        t = time.perf_counter()
        rec = host.start_engine(supervision.spec_key(spec), EngineRole.ACTIVE, spec=spec, replacing=pred,
                                generation=pred.generation + 1, extra_env=self._takeover_env(cmd, owner),
                                gang=cmd.gang)
        rec.taking_over = owner
        timings["spawn_ms"] = ms_since(t)
        t = time.perf_counter()
        await host.wait_ready(rec.engine_id, 2 * spec.cold_start_s + host.settings.takeover_timeout_s)
        timings["attach_ready_ms"] = ms_since(t)
        return rec


def _retrieved(task: asyncio.Task[TakeoverReply]) -> None:
    """A promotion or a resumed takeover nobody joined: its failure said once, not as an exception never retrieved
    (one that gave way was said where it did)."""
    if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), GaveWay):
        log.error("takeover %s failed: %r", task.get_name(), task.exception())
