"""`IncidentDriver`: the leader's side of the pipeline (detect -> freeze -> route out -> reattach -> route in).

Every handler is idempotent by recorded progress (the record in etcd says which entry actions are done,
invariant 3 of `incident.py`), and every event it publishes has an id derived from the incident, so the
JetStream duplicate window drops a re-publication after a crash: a resumed incident finishes exactly once.
Order of work inside a step: act first, then record that the step is done (a crash in between redoes an
idempotent action instead of skipping one).

Durability (DESIGN.md section 4, latency budget): the opening is written and confirmed before anything is
done for the incident (it is what makes one incident per failed generation); every later record, and the
endpoint keys, are written behind through one fenced `BatchWriter` (grouped into etcd transactions, guarded
by the leader key). A queued record lost in a crash is redone by the next leader from the older record.
The fallback's cold-started successor: `cold_starts.py`; the incident's trace: `incident_trace.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from libs.common.bus import Bus, Wired, engines_on_their_nodes
from libs.common.etcd_batch import BatchWriter
from libs.common.events import (
    EndpointAdded,
    EndpointRemoved,
    EngineReady,
    EngineReattached,
    EngineRole,
    EngineStopped,
    Envelope,
    Event,
    FaultDetected,
    FaultKind,
    IncidentFailed,
    IncidentOpened,
    IncidentReason,
    IncidentResolved,
    IntentResult,
    LeaseChanged,
    LeaseState,
    MemoryFrozen,
    RecoverIntent,
    Step,
)
from libs.common.store import Store
from services.controller.batches import Batches
from services.controller.cold_starts import ColdStarts
from services.controller.incident import (
    WAITING,
    Deadlines,
    IncidentRecord,
    IncidentState,
    Trigger,
    apply,
    can,
    end_step,
    incident_id_for,
    opened_record,
    start_step,
)
from services.controller.incident_log import IncidentLog
from services.controller.incident_trace import IncidentTracer
from services.controller.metrics import ControllerMetrics
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.pipeline")
S = IncidentState

# Which incident states a dc_manager result may act in (a late result of an abandoned step is ignored).
RESULT_RULES: dict[tuple[Step, bool], tuple[Trigger, frozenset[IncidentState]]] = {
    (Step.FREEZE, True): (Trigger.FROZEN, frozenset({S.FREEZING})),
    (Step.FREEZE, False): (Trigger.STEP_FAILED, frozenset({S.FREEZING})),
    (Step.REATTACH, True): (Trigger.REATTACHED, frozenset({S.FREEZING, S.REATTACHING, S.FALLBACK})),
    (Step.REATTACH, False): (Trigger.STEP_FAILED, frozenset({S.FREEZING, S.REATTACHING})),
    (Step.FALLBACK, False): (Trigger.STEP_FAILED, frozenset({S.FALLBACK})),
}


class RouteOut(NamedTuple):
    """A dispatch prepared: the record's working copy and the events to publish (route out, the intent,
    incident.opened); `lost`: the memory is gone, `cold`: the successor starts cold; `model`: the route's model."""

    work: IncidentRecord
    events: list[Wired]
    lost: bool
    cold: bool
    model: str


def endpoint_key(model: str, engine_id: str) -> str:
    return f"endpoints/{model}/{engine_id}"


class IncidentDriver(ColdStarts, Batches):
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
        self.by_cold: dict[str, str] = {}  # cold-started successor engine id -> its incident
        self.deadlines = Deadlines(settings.freeze_deadline_s, settings.reattach_deadline_s, settings.fallback_deadline_s)
        self.open: dict[str, IncidentRecord] = {}
        self.tracing = IncidentTracer()
        self._locks: dict[str, asyncio.Lock] = {}
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._successors: set[str] = set()  # successors of open incidents (not announced on their own)
        # successors serving before their predecessor's memory is frozen (a shadow promoted while the freeze runs,
        # dc_manager promote_shadows_early), by incident: routed in when the freeze ends
        self._reattached_early: dict[str, dict[str, object]] = {}
        # Incidents this leader closed recently: the view (fed by the watch, behind the write-behind records)
        # may still show them open for a moment; without this the deadline pass would "resume" each one.
        self._closed: dict[str, None] = {}

    # ------------------------------------------------------------ lifecycle (leader only)

    async def start(self) -> None:
        """Resume every open incident from its record, then consume events (redelivered ones included)."""
        for rec in await self.log.open_records():
            self.open[rec.id] = rec
            if rec.state is S.FALLBACK and rec.cold_successor_id:
                self.by_cold[rec.cold_successor_id] = rec.id
            if rec.successor_id:
                self._successors.add(rec.successor_id)
        log.info("leader resumes %d open incident(s)", len(self.open))
        for inc_id in list(self.open):
            await self._guarded(inc_id, self._resume(inc_id))
        kw = {"concurrency": self.settings.concurrency, "ack_wait": self.settings.ack_wait_s}
        # Faults delivered together are opened together: one task, one wait for their creates, one publish
        # (and one wait for the stream acks) of their route-out events.
        subs = self.subscriptions
        subs.append(await self.bus.durable_batches("fault.detected", "controller-faults", self.on_faults,
                                                   vet=engines_on_their_nodes(self.view.engines), **kw))
        # A result is filed under its incident's recorded trace: its message's context need not be made current.
        # Results delivered together (prompt takeovers) are routed in together, as faults are opened.
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
        try:
            await self.writer.flush()
        finally:
            await self.writer.close()

    async def run_deadlines(self) -> None:
        """Level-triggered pass: missed deadlines, stalled local steps, incidents opened by any API."""
        while True:
            await asyncio.sleep(self.settings.tick_s)
            now = time.time()
            for rec in list(self.open.values()):
                lock = self._locks.get(rec.id)
                if rec.id in self._busy or (lock is not None and lock.locked()):
                    continue  # being worked on right now: nothing stalled
                if rec.state in WAITING and rec.deadline is not None and now > rec.deadline:
                    step = rec.state.value
                    self._background(rec.id, self.trigger(rec.id, Trigger.DEADLINE_MISSED, detail=f"{step} missed its deadline"))
                elif rec.state in (S.OPENED, S.ROUTING_IN) and now - rec.updated_at > 1.0:
                    self._background(rec.id, self._resume(rec.id))
                elif rec.state is S.FALLBACK and rec.cold_successor_id:
                    # Level-triggered: a ready event missed (or sent before the spawn was answered).
                    cold = self.view.engines.get(rec.cold_successor_id)
                    if cold is not None and cold.state == "ready":
                        self._background(rec.id, self._cold_ready(rec.id, cold.engine_id, cold.endpoint))
            for inc_id in list(self.view.open_by_engine.values()):
                seen = self.view.incidents.get(inc_id)
                if inc_id not in self.open and inc_id not in self._busy and inc_id not in self._closed \
                        and seen is not None and seen.state is S.OPENED:
                    self._background(inc_id, self._resume(inc_id))

    def _background(self, inc_id: str, coro: object) -> None:
        self._busy.add(inc_id)

        async def run() -> None:
            try:
                await coro  # type: ignore[misc]
            except Exception:  # noqa: BLE001 - retried on the next tick
                log.exception("incident %s: background step failed", inc_id)
            finally:
                self._busy.discard(inc_id)

        task = asyncio.create_task(run(), name=f"incident:{inc_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded(self, inc_id: str, coro: object) -> None:
        try:
            await coro  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - the deadline pass retries it
            log.exception("incident %s: resume failed", inc_id)

    def _lock(self, inc_id: str) -> asyncio.Lock:
        lock = self._locks.get(inc_id)  # not setdefault: that builds a Lock on every call, used or not
        if lock is None:
            lock = self._locks[inc_id] = asyncio.Lock()
        return lock

    # ------------------------------------------------------------ event handlers

    async def on_fault(self, env: Envelope) -> None:
        f = env.data
        assert isinstance(f, FaultDetected)
        if f.role is EngineRole.STANDBY:
            return  # a standby holds no leased memory; the agent replaces it on its own
        inc_id = incident_id_for(f.engine_id, f.generation)
        if inc_id in self._closed:
            return  # ended here: a late redelivery (its record may be gone already: libs/common/retention.py)
        other = self.view.open_incident_for(f.engine_id)
        if other is not None and other.id != inc_id:
            # Already being replaced on purpose: a GPU fault now means its memory is gone.
            if f.kind is FaultKind.GPU_FAULT:
                await self.trigger(other.id, Trigger.MEMORY_LOST, detail="gpu fault during the incident")
            return
        async with self._lock(inc_id):
            rec = self.open.get(inc_id)
            if rec is None:
                # Create first (the common case: a new fault); only a redelivery finds it there and loads it.
                rec = self._record_from_fault(inc_id, f, env)
                if await self.log.create(rec):
                    self.metrics.record_opened(rec)
                    if self.tracing.export_spans:  # the detect step's span (no copy made when none is exported)
                        self.tracing.steps(rec.model_copy(update={"steps": {}}), rec)
                    log.info("incident %s opened: %s %s", inc_id, f.engine_id, f.kind)
                else:
                    rec = await self.log.load(inc_id)
            if rec is None or rec.terminal:
                return
            self.open[inc_id] = rec
            await self._advance(rec)

    async def on_intent_result(self, env: Envelope) -> None:
        r = env.data
        assert isinstance(r, IntentResult)
        if r.step is Step.FALLBACK and r.ok:
            await self._cold_spawned(r)
            return
        trigger, states = RESULT_RULES[(r.step, r.ok)]
        changes = {}
        if r.successor_id:
            changes = {"successor_id": r.successor_id, "successor_endpoint": r.endpoint}
        await self.trigger(r.incident_id, trigger, states=states, detail=r.detail, frozen_at=r.frozen_at, **changes)

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
                await self._emit_once(EndpointRemoved(model=model, engine_id=e.engine_id, url=url, reason="stopped"),
                                      f"stopped-{e.engine_id}")

    async def on_memory_event(self, env: Envelope) -> None:
        e = env.data
        if isinstance(e, MemoryFrozen) and e.incident_id:
            await self.trigger(e.incident_id, Trigger.FROZEN, states=frozenset({S.FREEZING}))
        elif isinstance(e, LeaseChanged) and e.lease.state is LeaseState.RECLAIMED:
            inc = self.view.open_incident_for(e.lease.owner)
            if inc is not None:
                await self.trigger(inc.id, Trigger.MEMORY_LOST, states=frozenset({S.FREEZING, S.REATTACHING}),
                                   detail=f"lease {e.lease.id} reclaimed", memory_lost=True)

    async def _engine_ready(self, e: EngineReady) -> None:
        info = e.engine
        inc_id = self.by_cold.get(info.engine_id)
        if inc_id is not None:
            await self._cold_ready(inc_id, info.engine_id, info.endpoint)
            return
        if info.role is not EngineRole.ACTIVE or not info.endpoint:
            return
        if self.view.open_incident_for(info.engine_id) is not None:
            return  # it is failing: do not announce it
        if info.engine_id in self._successors or e.takeover_of is not None:
            return  # a successor: route-in announces it with its predecessor (before or after this event)
        self.writer.put_nowait(endpoint_key(info.model, info.engine_id), info.endpoint)
        await self._emit_once(EndpointAdded(model=info.model, engine_id=info.engine_id, url=info.endpoint),
                              f"ready-{info.engine_id}-g{info.generation}")

    # ------------------------------------------------------------ moving an incident

    async def trigger(self, inc_id: str, trigger: Trigger, *, states: frozenset[IncidentState] | None = None,
                      detail: str = "", frozen_at: float | None = None, **changes: object) -> None:
        """`frozen_at`: the trigger reports what followed a freeze that ended then (the dc_manager's one
        result per intent); a record still freezing first ends its freeze step at that time."""
        async with self._lock(inc_id):
            rec = self.open.get(inc_id) or await self.log.load(inc_id)
            if rec is None:
                return
            cur = rec
            if frozen_at is not None and rec.state is S.FREEZING and trigger is not Trigger.FROZEN:
                cur = self._frozen_at(rec, frozen_at)
            if trigger is Trigger.REATTACHED and cur.state is S.FREEZING:
                # The successor serves already, its memory not frozen yet: routed in when the freeze ends
                # (memory.frozen or the dc_manager's result), never before (incident.py: no such transition).
                self._reattached_early[inc_id] = changes
                return
            if not can(cur.state, trigger) or (states is not None and cur.state not in states):
                return  # unknown, finished, or a late result of an abandoned step: nothing to do
            new = apply(cur, trigger, time.time(), self.deadlines, detail=detail, **changes)
            early = self._reattached_early.pop(inc_id, None) if new.state is S.REATTACHING else None
            if early is not None:
                new = apply(new, Trigger.REATTACHED, time.time(), self.deadlines, **early)  # type: ignore[arg-type]
            if rec.state is S.FALLBACK and trigger is Trigger.REATTACHED and rec.cold_successor_id:
                self._stop_cold(rec)
                new.cold_stopped = True
            if new.state is S.FALLBACK:
                await self._send_intent(new, fallback=True)
            elif new.state is S.FAILED:
                await self._emit_once(IncidentFailed(incident_id=new.id, engine_id=new.engine_id,
                                                     step=self._failed_step(rec), reason=new.failure or ""),
                                      f"{new.id}-failed", new)
            # Entering route-in, the record is not written: route-in follows at once and writes the next one
            # (a crash before it redoes the step from the result, which is acked only after route-in).
            rec = await self._commit(rec, new, write=new.state is not S.ROUTING_IN)
            await self._advance(rec)

    def _frozen_at(self, rec: IncidentRecord, frozen_at: float) -> IncidentRecord:
        """A record still freezing, its freeze ended at `frozen_at` (bounded by its start and now)."""
        now = time.time()
        started = rec.steps.get(Step.FREEZE)
        return apply(rec, Trigger.FROZEN, min(now, max(frozen_at, started.started_at if started else frozen_at)),
                     self.deadlines)

    async def _resume(self, inc_id: str) -> None:
        async with self._lock(inc_id):
            await self._resume_unlocked(inc_id)

    async def _resume_unlocked(self, inc_id: str) -> None:
        rec = self.open.get(inc_id) or await self.log.load(inc_id)
        if rec is None or rec.terminal:
            self.open.pop(inc_id, None)
            return
        self.open[inc_id] = rec
        await self._advance(rec)

    async def _advance(self, rec: IncidentRecord) -> None:
        """Run the controller's own steps (route out and dispatch; route in and close) until it must wait."""
        while True:
            if rec.state is S.OPENED:
                # The waiting state's record is written only if the incident is still waiting a moment later
                # (a prompt takeover's incident goes from opened to resolved with no record in between; a new
                # leader resumes it from opened: the dispatch is idempotent).
                rec = await self._commit(rec, await self._dispatch(rec), after_s=self.settings.waiting_record_delay_s)
            elif rec.state is S.ROUTING_IN:
                try:
                    routed = await self._route_in(rec)
                except BaseException:
                    self.log.save(rec)  # maybe not written on entry (see trigger): keep where it stands now
                    raise
                rec = await self._routed_in(rec, routed)
            else:
                return

    async def _dispatch(self, rec: IncidentRecord) -> IncidentRecord:
        out = self._route_out(rec)
        await self.bus.publish_all(out.events)  # published together, their stream acks awaited together
        return self._routed_out(out)

    def _route_out(self, rec: IncidentRecord) -> RouteOut:
        """The dispatch's events (route out, the intent, incident.opened) for `rec`'s working copy; once they
        are published, `_routed_out` takes it on."""
        work = rec.model_copy(update={"steps": dict(rec.steps)})  # steps are replaced, never mutated
        if work.trace_parent is None:
            self.tracing.open(work)
        start_step(work, Step.ROUTE_OUT, time.time())
        hit = self.view.endpoint_of(work.engine_id)
        model, url = hit if hit is not None else (work.model, work.endpoint)
        # Route out beside the freeze: routers hold requests while the memory is frozen.
        lost = work.memory_lost or self._memory_gone(work)
        cold = lost or work.move_off  # moving off a drained node: the successor starts cold elsewhere
        events = [
            self._intent_envelope(work, fallback=cold),
            self._envelope(IncidentOpened(incident_id=work.id, engine_id=work.engine_id, reason=work.reason,
                                          kind=work.kind, model=work.model, gpu=work.gpu),
                           f"{work.id}-opened", work),
        ]
        if not work.move_off:
            events.insert(0, self._envelope(EndpointRemoved(model=model or work.model, engine_id=work.engine_id, url=url,
                                                            reason=str(work.kind or work.reason), incident_id=work.id),
                                            f"{work.id}-removed", work))
        return RouteOut(work, events, lost, cold, model or work.model)

    def _routed_out(self, out: RouteOut) -> IncidentRecord:
        work = out.work
        if work.move_off:  # make before break: a drained engine serves until its successor does (route-in)
            end_step(work, Step.ROUTE_OUT, "skipped", time.time(), "drain: routed out when its successor is routed in")
        else:
            self.writer.delete_nowait(endpoint_key(out.model, work.engine_id))
            end_step(work, Step.ROUTE_OUT, "done", time.time())
        trig = Trigger.DISPATCHED_FALLBACK if out.cold else Trigger.DISPATCHED
        return apply(work, trig, time.time(), self.deadlines, memory_lost=out.lost)

    async def _route_in(self, rec: IncidentRecord) -> IncidentRecord:
        new, events = self._route_in_events(rec)
        await self.bus.publish_all(events)
        return new

    async def _routed_in(self, rec: IncidentRecord, routed: IncidentRecord) -> IncidentRecord:
        """Route-in's events are published: record the incident resolved."""
        rec = await self._commit(rec, routed)
        if rec.move_off and rec.state is S.RESOLVED and rec.successor_id != rec.engine_id:
            # Drained: its successor serves now; stop it (best effort, like a superseded cold engine).
            self._stop_in_background(rec.id, rec.engine_id, rec.node)
        return rec

    def _route_in_events(self, rec: IncidentRecord) -> tuple[IncidentRecord, list[Wired]]:
        """Route-in's endpoint key (written behind) and events for `rec`, and the record once they are out."""
        succ, url = rec.successor_id or "", rec.successor_endpoint
        engine = self.view.engines.get(succ)
        url = url or (engine.endpoint if engine else None) or ""
        if succ and url:
            self.writer.put_nowait(endpoint_key(rec.model, succ), url)
        new = apply(rec, Trigger.ROUTED_IN, time.time(), self.deadlines)
        events = [
            self._envelope(EndpointAdded(model=rec.model, engine_id=succ, url=url, incident_id=rec.id,
                                         predecessor_id=rec.engine_id), f"{rec.id}-added", rec),
            self._envelope(IncidentResolved(incident_id=new.id, engine_id=new.engine_id, successor_id=succ or None,
                                            timings_ms=new.timings_ms(), total_ms=new.total_ms() or 0.0,
                                            fallback=new.fallback), f"{new.id}-resolved", new),
        ]
        if rec.move_off:  # the drained engine's route goes only now, after its successor's (make before break)
            hit = self.view.endpoint_of(rec.engine_id)
            model, old_url = hit if hit is not None else (rec.model, rec.endpoint)
            self.writer.delete_nowait(endpoint_key(model, rec.engine_id))
            events.insert(1, self._envelope(EndpointRemoved(model=model, engine_id=rec.engine_id, url=old_url,
                                                            reason="drained", incident_id=rec.id),
                                            f"{rec.id}-removed", rec))
        return new, events

    async def _send_intent(self, rec: IncidentRecord, *, fallback: bool) -> None:
        await self.bus.publish(self._intent_envelope(rec, fallback=fallback))

    def _intent_envelope(self, rec: IncidentRecord, *, fallback: bool) -> Wired:
        intent = RecoverIntent(incident_id=rec.id, engine_id=rec.engine_id, model=rec.model,
                               engine_class=rec.engine_class, gpu=rec.gpu, reason=rec.reason, kind=rec.kind,
                               memory_lost=fallback, version=rec.version, node=rec.node,
                               successor=rec.successor_hint)
        return self._envelope(intent, f"{rec.id}-intent-{'fallback' if fallback else 'recover'}", rec)

    async def _commit(self, old: IncidentRecord, new: IncidentRecord, *, write: bool = True,
                      after_s: float = 0.0) -> IncidentRecord:
        new.leader = self.settings.instance  # `new` is this call's own copy (apply and the callers copy)
        if write and after_s > 0:
            self.log.save_after(new, after_s)
        elif write:
            self.log.save(new)  # written behind, fenced by the leader key (incident_log.py)
        if old.successor_id != new.successor_id:
            self._successors.discard(old.successor_id or "")
        if new.successor_id and not new.terminal:
            self._successors.add(new.successor_id)
        elif new.successor_id:
            self._successors.discard(new.successor_id)
        self.tracing.steps(old, new)
        if new.terminal:
            self.open.pop(new.id, None)
            self._reattached_early.pop(new.id, None)
            self._closed[new.id] = None
            if len(self._closed) > 100_000:  # bounded: the oldest half goes (long since in the view)
                for old_id in list(self._closed)[:50_000]:
                    del self._closed[old_id]
            self._locks.pop(new.id, None)
            self.metrics.record_closed(new)
            self.tracing.close(new)
            log.info("incident %s %s in %s ms", new.id, new.state, new.total_ms())
        else:
            self.open[new.id] = new
        return new

    # ------------------------------------------------------------ helpers

    def _record_from_fault(self, inc_id: str, f: FaultDetected, env: Envelope) -> IncidentRecord:
        engine = self.view.engines.get(f.engine_id)
        hit = self.view.endpoint_of(f.engine_id)
        rec = opened_record(
            id=inc_id, engine_id=f.engine_id, model=f.model or (engine.model if engine else "") or (hit[0] if hit else ""),
            engine_class=f.engine_class if f.engine_class != "default" or engine is None else engine.engine_class,
            generation=f.generation, node=f.node or env.node or (engine.node if engine else None), gpu=f.gpu,
            endpoint=(hit[1] if hit else None) or (engine.endpoint if engine else None),
            reason=IncidentReason.FAILURE, kind=f.kind, died_at=f.died_at,
            memory_lost=f.kind is FaultKind.GPU_FAULT, leader=self.settings.instance,
        )
        self.tracing.open(rec)
        return rec

    async def _emit_once(self, payload: Event, key: str, rec: IncidentRecord | None = None) -> None:
        """Publish with an id derived from the incident: JetStream drops a repeat after a crash. Filed under
        the incident's trace (its recorded traceparent is the context to propagate, as it is)."""
        await self.bus.publish(self._envelope(payload, key, rec))

    def _envelope(self, payload: Event, key: str, rec: IncidentRecord | None) -> Wired:
        # Wired: the envelope's JSON without its model (this process never reads these events back).
        return self.bus.wired(payload, id=key, traceparent=rec.trace_parent if rec else None)

    def _memory_gone(self, rec: IncidentRecord) -> bool:
        leases = self.view.leases_of(rec.engine_id)
        return bool(leases) and all(lease.state is LeaseState.RECLAIMED for lease in leases)

    @staticmethod
    def _failed_step(rec: IncidentRecord) -> Step:
        return {S.FREEZING: Step.FREEZE, S.REATTACHING: Step.REATTACH}.get(rec.state, Step.FALLBACK)
