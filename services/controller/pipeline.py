"""`IncidentDriver`: the leader's side of the pipeline (detect -> freeze -> route out -> reattach -> route in).

One path per step, for any number of incidents: what the durable consumers deliver in one loop pass
(`Bus.durable_batches`) is handled together, and a single event (an engine or memory event, a deadline) is a
batch of one on the same path. Faults open their incidents (the creates awaited together); results and
events become `Move`s, triggers of `incident.py`'s table; then `_advance` runs the controller's own steps for
every incident the batch moved: the route-outs of those opened published with one `publish_all` (one wait
for their stream acks), the route-ins of those whose successor is known likewise. Each incident keeps its
own lock, record and derived event ids, and a failure fails (and redelivers) only the messages it concerns:
the per-message outcome is what the consumer acks or naks.

Every step is idempotent by recorded progress (the record in etcd says which entry actions are done,
invariant 3 of `incident.py`), and every event published has an id derived from the incident, so the
JetStream duplicate window drops a re-publication after a crash: a resumed incident finishes exactly once.
Order of work inside a step: act first, then record that the step is done (a crash in between redoes an
idempotent action instead of skipping one).

Durability (DESIGN.md section 4, latency budget): the opening is written and confirmed before anything is
done for the incident (it is what makes one incident per failed generation); every later record, and the
endpoint keys, are written behind through one fenced `BatchWriter` (grouped into etcd transactions, guarded
by the leader key). A queued record lost in a crash is redone by the next leader from the older record.
The events built: `routes.py`; the open records and their indexes: `open_incidents.py`; engines stopped:
`engine_stops.py`; the incident's trace: `incident_trace.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from libs.common.bus import Bus, engines_on_their_nodes, holding
from libs.common.etcd_batch import BatchWriter
from libs.common.events import (
    EndpointAdded,
    EndpointRemoved,
    EngineReady,
    EngineReattached,
    EngineRole,
    EngineStopped,
    Envelope,
    FaultDetected,
    IncidentReason,
    IntentResult,
    LeaseChanged,
    LeaseState,
    MemoryFrozen,
    Step,
    group_of_rank,
)
from libs.common.ids import cold_parent_of
from libs.common.store import Store
from services.controller.endings import IncidentEnds
from services.controller.engine_stops import EngineStops
from services.controller.incident import (
    WAITING,
    Deadlines,
    IncidentRecord,
    IncidentState,
    Trigger,
    apply,
    can,
    incident_id_for,
    opened_record,
)
from services.controller.incident_log import IncidentLog
from services.controller.incident_trace import IncidentTracer
from services.controller.metrics import ControllerMetrics
from services.controller.open_incidents import OpenIncidents
from services.controller.routes import IncidentEvents, endpoint_key
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.pipeline")
S = IncidentState
Outcomes = list[BaseException | None]  # per message of a batch, in order: None (acked) or what failed it

# Which incident states a dc_manager result may act in (a late result of an abandoned step is ignored).
RESULT_RULES: dict[tuple[Step, bool], tuple[Trigger, frozenset[IncidentState]]] = {
    (Step.FREEZE, True): (Trigger.FROZEN, frozenset({S.FREEZING})),
    (Step.FREEZE, False): (Trigger.STEP_FAILED, frozenset({S.FREEZING})),
    (Step.REATTACH, True): (Trigger.REATTACHED, frozenset({S.FREEZING, S.REATTACHING, S.FALLBACK})),
    (Step.REATTACH, False): (Trigger.STEP_FAILED, frozenset({S.FREEZING, S.REATTACHING})),
    (Step.FALLBACK, True): (Trigger.COLD_STARTED, frozenset({S.FALLBACK})),
    (Step.FALLBACK, False): (Trigger.STEP_FAILED, frozenset({S.FALLBACK})),
}


class Move(NamedTuple):
    """A trigger for one incident, from message `at` of its batch. `states`: the states it may act in (None:
    wherever the table allows it); `frozen_at`: it reports what followed a freeze that ended then (the
    dc_manager's one result per intent): a record still freezing first ends its freeze at that time."""

    at: int
    inc_id: str
    trigger: Trigger
    states: frozenset[IncidentState] | None = None
    detail: str = ""
    frozen_at: float | None = None
    changes: dict[str, Any] = {}  # noqa: RUF012 - never mutated


class IncidentDriver:
    def __init__(self, bus: Bus, store: Store, view: ClusterView, settings: ControllerSettings,
                 metrics: ControllerMetrics, fence: Callable[[Any], list[Any]]) -> None:
        self.bus = bus
        self.store = store
        self.view = view
        self.settings = settings
        self.metrics = metrics
        # Fencing: every write (batched or not) holds only while this term's leader key exists
        # (LeaderElection.fence): not after the lease is lost, nor in a later term of this same process.
        self.writer = BatchWriter(store, guard=fence, behind_linger_s=settings.record_linger_s)
        self.subscriptions: list[Any] = []  # the term's durable consumers (unsubscribed when it ends)
        self.writer.on_send = view.expect_own  # the view takes our records back from the watch unparsed
        self.log = IncidentLog(store, self.writer)
        self.deadlines = Deadlines(settings.freeze_deadline_s, settings.reattach_deadline_s, settings.fallback_deadline_s)
        self.open = OpenIncidents()  # all incident state is in these records (incident.py's table)
        self.tracing = IncidentTracer()
        self.events = IncidentEvents(bus, view, self.writer, self.tracing, self.deadlines)
        self.ends = IncidentEnds(bus, self.log, self.events)
        self.stops = EngineStops(bus, view)
        # Not incident state: who is working on an incident right now. Its lock (one holder at a time), and the
        # incidents the deadline pass handed to a background task (not handed again while that task runs).
        self._locks: dict[str, asyncio.Lock] = {}
        self._ended_locks: list[str] = []  # ended incidents' locks, dropped once released (`_drop_ended_locks`)
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._settling: asyncio.Task[None] | None = None  # the pass reading doubtful ends back (endings.py)

    # ------------------------------------------------------------ lifecycle (leader only)

    async def start(self) -> None:
        """Announce the ends an earlier term recorded but did not announce, resume every open incident from its
        record, then consume events (redelivered ones included)."""
        open_, unannounced = await self.log.to_take_over()
        await self.ends.take_over(unannounced)
        for rec in open_:
            self.open.put(rec)
        log.info("leader resumes %d open incident(s)", len(self.open))
        for inc_id in self.open:
            try:
                await self._resume(inc_id)
            except Exception:  # noqa: BLE001 - the deadline pass retries it
                log.exception("incident %s: resume failed", inc_id)
        kw: dict[str, Any] = {"concurrency": self.settings.concurrency, "ack_wait": self.settings.ack_wait_s}
        subs = self.subscriptions
        subs.append(await self.bus.durable_batches("fault.detected", "controller-faults", self.on_faults,
                                                   vet=engines_on_their_nodes(self.view.engines), **kw))
        # A result is filed under its incident's recorded trace: its message's context need not be made current.
        subs.append(await self.bus.durable_batches("intent.result", "controller-intents", self.on_results, **kw))
        subs.append(await self.bus.durable("engine.>", "controller-engines", self.on_engine_event, **kw))
        subs.append(await self.bus.durable("memory.>", "controller-memory", self.on_memory_event, **kw))

    async def stop(self) -> None:
        """Step down: consume nothing more (unacked events go to the next leader), end the background steps,
        and send what is queued: against the fence of a lost term every write fails (its waiters hear it and
        their events are redelivered); on a clean stop while still leading they are written."""
        for sub in self.subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self.subscriptions.clear()
        for task in list(self._tasks):
            task.cancel()
        self.stops.cancel()
        try:
            await self.writer.flush()
        finally:
            await self.writer.close()

    async def run_deadlines(self) -> None:
        """Level-triggered pass: missed deadlines, stalled local steps, incidents opened by any API."""
        while True:
            await asyncio.sleep(self.settings.tick_s)
            self._drop_ended_locks()
            if self.ends.doubts and (self._settling is None or self._settling.done()):
                self._settling = self._spawn(self._settle_ends(), "incident-ends:settle")
            now = time.time()
            for rec in self.open.records():
                lock = self._locks.get(rec.id)
                if rec.id in self._busy or (lock is not None and lock.locked()):
                    continue  # being worked on right now: nothing stalled
                if rec.state in WAITING and rec.deadline is not None and now > rec.deadline:
                    self._background(rec.id, self.trigger(rec.id, Trigger.DEADLINE_MISSED,
                                                          detail=f"{rec.state.value} missed its deadline"))
                elif rec.state in (S.OPENED, S.ROUTING_IN) and now - rec.updated_at > 1.0:
                    self._background(rec.id, self._resume(rec.id))
                elif rec.state is S.FALLBACK and rec.cold_successor_id:
                    # Level-triggered: a ready event missed (or sent before the spawn was answered).
                    cold = self.view.engines.get(rec.cold_successor_id)
                    if cold is not None and cold.state == "ready":
                        self._background(rec.id, self._cold_ready(rec.id, cold.engine_id, cold.endpoint))
            for inc_id in list(self.view.open_by_engine.values()):
                seen = self.view.incidents.get(inc_id)
                if inc_id not in self.open and inc_id not in self._busy and not self.open.closed_here(inc_id) \
                        and seen is not None and seen.state is S.OPENED:
                    self._background(inc_id, self._resume(inc_id))

    def _background(self, inc_id: str, coro: Any) -> None:
        self._busy.add(inc_id)

        async def run() -> None:
            try:
                await coro
            except Exception:  # noqa: BLE001 - retried on the next tick
                log.exception("incident %s: background step failed", inc_id)
            finally:
                self._busy.discard(inc_id)

        self._spawn(run(), f"incident:{inc_id}")

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)  # referenced until done; cancelled by `stop`
        task.add_done_callback(self._tasks.discard)
        return task

    async def _settle_ends(self) -> None:
        """Read back each doubtful end (endings.py) under its incident's lock; the first read that etcd does not
        answer ends the pass (the store is still failing: the next tick tries again)."""
        for inc_id in list(self.ends.doubts):
            try:
                async with self._holding([inc_id]):
                    rec = await self.ends.settle(inc_id)
                    if rec is not None and inc_id not in self.open:
                        self.open.put(rec)  # its end never landed: resumed from etcd's record (deadline pass)
            except Exception as e:  # noqa: BLE001 - etcd still failing: settled on a later tick
                log.info("incident ends not settled yet (%r): again on the next tick", e)
                return

    def _drop_ended_locks(self) -> None:
        """Forget the locks of incidents ended here, once nobody holds them (popped while held, a second holder
        could take a new lock of the same incident at once)."""
        keep = []
        for inc_id in self._ended_locks:
            lock = self._locks.get(inc_id)
            if lock is not None and lock.locked():
                keep.append(inc_id)
            elif inc_id not in self.open:
                self._locks.pop(inc_id, None)
        self._ended_locks = keep

    def _lock(self, inc_id: str) -> asyncio.Lock:
        lock = self._locks.get(inc_id)  # not setdefault: that builds a Lock on every call, used or not
        if lock is None:
            lock = self._locks[inc_id] = asyncio.Lock()
        return lock

    def _holding(self, inc_ids: Iterable[str]) -> contextlib.AbstractAsyncContextManager[None]:
        """Every incident's lock, taken in one order (sorted, each once): two batches never wait on each other
        in a cycle. A handler takes no lock while it holds these."""
        return holding([self._lock(inc_id) for inc_id in sorted(set(inc_ids))])

    # ------------------------------------------------------------ event handlers (batches; one event: a batch of one)

    async def on_faults(self, envs: list[Envelope]) -> Outcomes:
        """Faults delivered in one loop pass: each opens its incident (a redelivery finds it), or, for an engine
        already in another incident (replaced on purpose), a fault that loses memory says that memory is gone."""
        out: Outcomes = [None] * len(envs)
        opens: dict[str, tuple[int, FaultDetected, Envelope]] = {}
        moves: list[Move] = []
        for i, env in enumerate(envs):
            f = env.data
            if not isinstance(f, FaultDetected) or f.role is EngineRole.STANDBY:
                continue  # a standby holds no leased memory; the agent replaces it on its own
            if f.group is not None and not self._group_on_node(f, env):
                continue
            parent = self._cold_parent(f.engine_id)
            if parent is not None:  # a fallback's own engine died before it served: that cold start failed
                moves.append(Move(i, parent, Trigger.STEP_FAILED, frozenset({S.FALLBACK}),
                                  detail=f"its cold-started engine {f.engine_id} failed ({f.kind}) before it was ready"))
            inc_id = self._incident_of(f)
            if self.open.closed_here(inc_id):
                continue  # ended here (its record may be gone already: libs/common/retention.py)
            if f.group is not None:  # a rank's fault joins its group's incident (no-op for the rank that opened it)
                moves.append(Move(i, inc_id, Trigger.RANK_FAULTED, changes={"rank": f.engine_id}))
            if inc_id in opens:
                continue  # a repeat, or another rank of the same group
            other = self.view.open_incident_for(f.group or f.engine_id)
            if other is not None and other.id != inc_id:
                if f.kind.loses_memory:
                    moves.append(Move(i, other.id, Trigger.MEMORY_LOST, detail=f"{f.kind.replace('_', ' ')} during the incident"))
                continue
            opens[inc_id] = (i, f, env)
        async with self._holding([*opens, *(m.inc_id for m in moves)]):
            moved = await self._open(list(opens.values()), out)
            moved.update(await self._apply(moves, out))
            await self._advance(moved, out)
        return out

    async def on_results(self, envs: list[Envelope]) -> Outcomes:
        """Intent results delivered in one loop pass, each a trigger of its incident (in order: a freeze's result
        and its reattach's, delivered together, move it twice)."""
        moves = []
        for i, env in enumerate(envs):
            r = env.data
            if not isinstance(r, IntentResult):
                continue
            trigger, states = RESULT_RULES[(r.step, r.ok)]
            changes: dict[str, Any] = {}
            if trigger is Trigger.COLD_STARTED:
                changes = {"cold_successor_id": r.successor_id, "cold_successor_endpoint": r.endpoint,
                           "cold_successor_node": r.node}
            elif r.successor_id:
                changes = {"successor_id": r.successor_id, "successor_endpoint": r.endpoint}
            moves.append(Move(i, r.incident_id, trigger, states, r.detail, r.frozen_at, changes))
        return await self._moved(moves, len(envs))

    async def on_engine_event(self, env: Envelope) -> None:
        e = env.data
        if isinstance(e, EngineReattached):
            inc_id = e.incident_id or (self.view.open_by_engine.get(e.predecessor_id) or "")
            if inc_id:
                await self.trigger(inc_id, Trigger.REATTACHED, states=frozenset({S.FREEZING, S.REATTACHING, S.FALLBACK}),
                                   successor_id=e.engine.engine_id, successor_endpoint=e.engine.endpoint)
        elif isinstance(e, EngineReady):
            await self._engine_ready(e)
        elif isinstance(e, EngineStopped):
            hit = self.view.endpoint_of(e.engine_id)
            if hit is not None and self.view.open_incident_for(e.engine_id) is None:
                model, url = hit
                self.writer.delete_nowait(endpoint_key(model, e.engine_id))
                await self.bus.publish(self.events.envelope(
                    EndpointRemoved(model=model, engine_id=e.engine_id, url=url, reason="stopped"),
                    f"stopped-{e.engine_id}", None))

    async def on_memory_event(self, env: Envelope) -> None:
        e = env.data
        if isinstance(e, MemoryFrozen) and e.incident_id:
            await self.trigger(e.incident_id, Trigger.FROZEN, states=frozenset({S.FREEZING}))
        elif isinstance(e, LeaseChanged) and e.lease.state is LeaseState.RECLAIMED:
            inc = self.view.open_incident_for(e.lease.owner) or self._group_incident_of(e.lease.owner)
            if inc is not None:
                await self.trigger(inc.id, Trigger.MEMORY_LOST, states=frozenset({S.FREEZING, S.REATTACHING}),
                                   detail=f"lease {e.lease.id} reclaimed", memory_lost=True)

    async def _engine_ready(self, e: EngineReady) -> None:
        info = e.engine
        inc_id = self.open.incident_of_cold(info.engine_id)
        if inc_id is not None:
            await self._cold_ready(inc_id, info.engine_id, info.endpoint)
            return
        if info.role is not EngineRole.ACTIVE or not info.endpoint:
            return
        if self.view.open_incident_for(info.engine_id) is not None:
            return  # it is failing: do not announce it
        if self.open.is_successor(info.engine_id) or e.takeover_of is not None:
            return  # a successor: route-in announces it with its predecessor (before or after this event)
        self.writer.put_nowait(endpoint_key(info.model, info.engine_id), info.endpoint)
        await self.bus.publish(self.events.envelope(
            EndpointAdded(model=info.model, engine_id=info.engine_id, url=info.endpoint),
            f"ready-{info.engine_id}-g{info.generation}", None))

    async def _cold_ready(self, inc_id: str, engine_id: str, endpoint: str | None) -> None:
        """The fallback's cold-started engine reports ready: routed in (if it is still the incident's)."""
        await self.trigger(inc_id, Trigger.SPAWNED, states=frozenset({S.FALLBACK}), successor_id=engine_id,
                           successor_endpoint=endpoint)

    async def trigger(self, inc_id: str, trigger: Trigger, *, states: frozenset[IncidentState] | None = None,
                      detail: str = "", frozen_at: float | None = None, **changes: Any) -> None:
        """One trigger: a batch of one (`Move`)."""
        out = await self._moved([Move(0, inc_id, trigger, states, detail, frozen_at, changes)], 1)
        if out[0] is not None:
            raise out[0]

    async def _resume(self, inc_id: str) -> None:
        out: Outcomes = [None]
        async with self._holding([inc_id]):
            rec = self.open.get(inc_id) or await self.log.load(inc_id)
            if rec is None or rec.terminal:
                self.open.drop(inc_id)
                return
            self.open.put(rec)
            await self._advance({inc_id: 0}, out)
        if out[0] is not None:
            raise out[0]

    # ------------------------------------------------------------ the path (its callers hold the incidents' locks)

    async def _moved(self, moves: list[Move], n: int) -> Outcomes:
        out: Outcomes = [None] * n
        async with self._holding(m.inc_id for m in moves):
            await self._advance(await self._apply(moves, out), out)
        return out

    async def _open(self, faults: list[tuple[int, FaultDetected, Envelope]], out: Outcomes) -> dict[str, int]:
        """Each fault's incident, opened here (creates queued together, awaited together) or, found in etcd (a
        redelivery), loaded. Returns the incidents to advance, by id: the message each one came from."""
        found: dict[str, int] = {}
        created = []
        for i, f, env in faults:
            inc_id = self._incident_of(f)
            if inc_id in self.open:
                found[inc_id] = i
                continue
            try:
                rec = self._record_from_fault(inc_id, f, env)
            except Exception as e:  # noqa: BLE001 - this fault alone is redelivered
                out[i] = e
                continue
            created.append((i, rec, self.log.create_soon(rec)))  # create first: the common case is a new fault
        for i, rec, fut in created:
            try:
                if await fut:
                    self.metrics.record_opened(rec)
                    if self.tracing.export_spans:  # the detect step's span (no copy made when none is exported)
                        self.tracing.steps(rec.model_copy(update={"steps": {}}), rec)
                    log.info("incident %s opened: %s %s", rec.id, rec.engine_id, rec.kind)
                else:  # it exists (a redelivery): load it
                    loaded = await self.log.load(rec.id)
                    if loaded is None or loaded.terminal:
                        continue
                    rec = loaded
            except Exception as e:  # noqa: BLE001 - etcd failed this create or load: redelivered
                out[i] = e
                continue
            self.open.put(rec)
            found[rec.id] = i
        return found

    async def _apply(self, moves: list[Move], out: Outcomes) -> dict[str, int]:
        """Each move, in order, on its incident's latest record; the waiting states' entry actions done (the
        fallback's intent sent, a failure announced). Returns the incidents moved, by id: their message."""
        moved: dict[str, int] = {}
        moves = list(moves)  # a move may bring another (a cold engine found ready)
        for m in moves:
            try:
                rec = self.open.get(m.inc_id) or await self.log.load(m.inc_id)
                new = self._next(rec, m) if rec is not None else None
                if rec is None or new is None:
                    continue
                if new.state is S.FALLBACK and rec.state is not S.FALLBACK:
                    await self.bus.publish(self.events.intent(new, fallback=True))
                if new.state is S.FAILED:  # recorded first, then announced (endings.py)
                    await self.ends.announce([(m.at, new, self._end(rec, new))], out)
                    continue
                # Entering route-in, the record is not written: route-in follows at once and writes the next
                # one (a crash before it redoes the step from the result, which is acked only after route-in).
                self._commit(rec, new, write=new.state is not S.ROUTING_IN)
                moved[m.inc_id] = m.at
                if m.trigger is Trigger.COLD_STARTED:
                    ready = self.view.engines.get(new.cold_successor_id or "")
                    if ready is not None and ready.state == "ready":  # ready before the spawn was answered
                        moves.append(Move(m.at, m.inc_id, Trigger.SPAWNED, frozenset({S.FALLBACK}),
                                          changes={"successor_id": ready.engine_id,
                                                   "successor_endpoint": ready.endpoint}))
            except Exception as e:  # noqa: BLE001 - this message alone is redelivered
                out[m.at] = e
        return moved

    def _next(self, rec: IncidentRecord, m: Move) -> IncidentRecord | None:
        """The record after `m`, or None when `m` does not apply (unknown, finished, a late result of an
        abandoned step, a fact already recorded)."""
        cur = rec
        if m.frozen_at is not None and rec.state is S.FREEZING and m.trigger is not Trigger.FROZEN:
            cur = self._frozen_at(rec, m.frozen_at)
        if m.trigger is Trigger.COLD_STARTED and not self._cold_started_is_news(cur, m.changes):
            return None
        changes = m.changes
        if m.trigger is Trigger.RANK_FAULTED:
            rank = changes["rank"]
            if rank in cur.ranks_faulted or not can(cur.state, m.trigger):
                return None  # the rank that opened it, a redelivery, or a group already recovered
            changes = {"ranks_faulted": [*cur.ranks_faulted, rank]}
            log.info("incident %s: rank %s of group %s faulted too (joins)", cur.id, rank, cur.engine_id)
        if m.trigger is Trigger.SPAWNED and (m.inc_id not in self.open
                                             or cur.cold_successor_id != m.changes.get("successor_id")):
            return None  # not this leader's, or not its cold engine (superseded)
        if not can(cur.state, m.trigger) or (m.states is not None and cur.state not in m.states):
            # A freeze's end (`frozen_at`) may have routed a successor recorded early in already (incident.py,
            # invariant 5): the reattach this result reports; otherwise the move does not apply.
            return cur if cur is not rec and cur.state is S.ROUTING_IN else None
        if m.trigger is Trigger.SPAWNED:
            changes = {**changes, "successor_endpoint": changes.get("successor_endpoint") or cur.cold_successor_endpoint}
        new = apply(cur, m.trigger, time.time(), self.deadlines, detail=m.detail, **changes)
        if rec.state is S.FALLBACK and m.trigger is Trigger.REATTACHED and rec.cold_successor_id:
            self.stops.stop(rec.id, rec.cold_successor_id, rec.cold_successor_node)  # the late reattach won
            new.cold_stopped = True
        return new

    def _cold_started_is_news(self, rec: IncidentRecord, cold: dict[str, Any]) -> bool:
        """The fallback's engine was started. Not news when already recorded; and when a reattach won before
        the spawn was even answered, that engine is not needed: stopped."""
        engine_id = cold.get("cold_successor_id")
        if not engine_id:
            return False
        if rec.state is not S.FALLBACK:
            if rec.successor_id != engine_id and not rec.cold_stopped:
                self.stops.stop(rec.id, engine_id, cold.get("cold_successor_node"))
            return False
        return rec.cold_successor_id != engine_id

    def _frozen_at(self, rec: IncidentRecord, frozen_at: float) -> IncidentRecord:
        """A record still freezing, its freeze ended at `frozen_at` (bounded by its start and now)."""
        now = time.time()
        started = rec.steps.get(Step.FREEZE)
        return apply(rec, Trigger.FROZEN, min(now, max(frozen_at, started.started_at if started else frozen_at)),
                     self.deadlines)

    async def _advance(self, moved: dict[str, int], out: Outcomes) -> None:
        """Run the controller's own steps (route out and dispatch; route in and close) for every incident moved,
        each step for all of them at once, until each must wait for others."""
        while moved:
            opened, routing = {}, {}
            for inc_id, at in moved.items():
                rec = self.open.get(inc_id)
                if rec is not None and out[at] is None:
                    if rec.state is S.OPENED:
                        opened[inc_id] = at
                    elif rec.state is S.ROUTING_IN:
                        routing[inc_id] = at
            await self._route_in(routing, out)
            moved = await self._route_out(opened, out)

    async def _route_out(self, opened: dict[str, int], out: Outcomes) -> dict[str, int]:
        """Route out and dispatch (their events published together). The waiting state's record is written only
        if the incident still waits a moment later (a prompt takeover's incident goes from opened to resolved
        with no record in between; a new leader resumes it from opened: the dispatch is idempotent)."""
        if not opened:
            return {}
        staged = []
        for inc_id, at in opened.items():
            rec = self.open.get(inc_id)
            try:
                if rec is not None:
                    staged.append((rec, at, self.events.route_out(rec)))
            except Exception as e:  # noqa: BLE001 - redelivered (its record says opened)
                out[at] = e
        try:
            await self.bus.publish_all([ev for _, _, r in staged for ev in r.events])
        except Exception as e:  # noqa: BLE001 - none of them is routed out: all redelivered (idempotent)
            for _, at, _ in staged:
                out[at] = e
            return {}
        moved = {}
        for rec, at, r in staged:
            try:
                self._commit(rec, self.events.routed_out(r), after_s=self.settings.waiting_record_delay_s)
                moved[rec.id] = at
            except Exception as e:  # noqa: BLE001 - redelivered
                out[at] = e
        return moved

    async def _route_in(self, routing: dict[str, int], out: Outcomes) -> None:
        """Route in (the successors' endpoints published together), then close: each incident's resolved record
        written and confirmed, then its incident.resolved published (endings.py)."""
        if not routing:
            return
        staged = []
        for inc_id, at in routing.items():
            rec = self.open.get(inc_id)
            if rec is None:
                continue
            try:
                staged.append((rec, at, self.events.route_in(rec)))
            except Exception as e:  # noqa: BLE001 - redelivered
                self.log.save(rec)  # maybe not written on entry (see _apply): kept where it stands now
                out[at] = e
        try:
            await self.bus.publish_all([ev for _, _, r in staged for ev in r.events])
        except Exception as e:  # noqa: BLE001 - none routed in: each redelivered, its record kept as it stands
            for rec, at, _ in staged:
                self.log.save(rec)  # maybe not written on entry (see _apply): kept where it stands now
                out[at] = e
            return
        ends = []
        for rec, at, r in staged:
            try:
                ends.append((at, r.record, self._end(rec, r.record)))
                if rec.move_off and rec.successor_id != rec.engine_id:
                    # Drained: its successor serves now; stop it (best effort, like a superseded cold engine).
                    self.stops.stop(rec.id, rec.engine_id, rec.node)
            except Exception as e:  # noqa: BLE001 - redelivered
                out[at] = e
        await self.ends.announce(ends, out)

    def _end(self, old: IncidentRecord, new: IncidentRecord) -> asyncio.Future[None]:
        """An incident ends (`new` is terminal): closed here at once, and its record's write started; the end is
        announced only once that write is confirmed (endings.py)."""
        self._commit(old, new, write=False)
        return self.log.write_soon(new)

    def _commit(self, old: IncidentRecord, new: IncidentRecord, *, write: bool = True, after_s: float = 0.0) -> None:
        """`new` is the incident's record from now on: in the table, and queued to etcd (written behind, fenced by
        the leader key: incident_log.py) unless `write` is False."""
        new.leader = self.settings.instance  # `new` is this call's own copy (apply and the callers copy)
        if write and after_s > 0:
            self.log.save_after(new, after_s)
        elif write:
            self.log.save(new)
        self.tracing.steps(old, new)
        self.open.put(new)
        if new.terminal:
            self._ended_locks.append(new.id)
            self.metrics.record_closed(new)
            self.tracing.close(new)
            log.info("incident %s %s in %s ms", new.id, new.state, new.total_ms())

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _incident_of(f: FaultDetected) -> str:
        """incident.py, invariants 1 and 7: the failed generation's, a TP group's whichever rank faulted."""
        return incident_id_for(f.group or f.engine_id, f.generation)

    def _cold_parent(self, engine_id: str) -> str | None:
        """The open incident in fallback whose cold start `engine_id` is, if any: the one recorded, or the one its
        id names (`cold_engine_id`: the engine may fail before the fallback's result records it)."""
        inc_id = self.open.incident_of_cold(engine_id) or cold_parent_of(engine_id)
        rec = self.open.get(inc_id) if inc_id else None
        return rec.id if rec is not None and rec.state is S.FALLBACK else None

    def _group_incident_of(self, owner: str) -> IncidentRecord | None:
        """The open incident of the TP group whose rank `owner` is (its leases are the group's memory), if any."""
        group = self.view.engines.get(group_of_rank(owner) or "")
        return self.view.open_incident_for(group.engine_id) if group is not None and owner in group.ranks else None

    def _group_on_node(self, f: FaultDetected, env: Envelope) -> bool:
        """A rank's fault names its group: refused (logged, acked) when that group's record is another node's (a
        node faults only its own engines: the bus vets `engine_id`, this vets `group`)."""
        group = self.view.engines.get(f.group or "")
        if group is None or group.node == env.node:
            return True
        log.warning("fault of %s from node %s names group %s of node %s: ignored", f.engine_id, env.node, f.group,
                    group.node)
        return False

    def _record_from_fault(self, inc_id: str, f: FaultDetected, env: Envelope) -> IncidentRecord:
        engine_id = f.group or f.engine_id  # a TP group's incident is its rank 0's, the group's one endpoint
        engine = self.view.engines.get(engine_id)
        hit = self.view.endpoint_of(engine_id)
        rec = opened_record(
            id=inc_id, engine_id=engine_id, gang=f.gang or (engine.gang if engine else None),
            ranks_faulted=[f.engine_id] if f.group else [], model=f.model or (engine.model if engine else "") or (hit[0] if hit else ""),
            engine_class=f.engine_class if f.engine_class != "default" or engine is None else engine.engine_class,
            generation=f.generation, node=f.node or env.node or (engine.node if engine else None), gpu=f.gpu,
            endpoint=(hit[1] if hit else None) or (engine.endpoint if engine else None),
            reason=IncidentReason.FAILURE, kind=f.kind, died_at=f.died_at,
            memory_lost=f.kind.loses_memory, leader=self.settings.instance,
        )
        self.tracing.open(rec)
        return rec
