"""`IncidentEvents`: what the pipeline's own steps publish and write for one incident, built without sending.

Route out (the endpoint removed, the recover intent, incident.opened) and route in (the successor's endpoint
added, incident.resolved), each with its endpoint key queued behind on the `BatchWriter`. The pipeline sends
the events of many incidents with one `publish_all` (pipeline.py); every event's id is derived from its
incident, so a re-publication after a crash is dropped by JetStream's duplicate window.

A drained node's engine (`move_off`) is routed make-before-break: its route stays until its successor's
route is added, in the same publication. An incident begun on purpose that fails while its engine still serves
(`serves_on`) routes that engine back in at its end, in place of telling routers that no successor comes.
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple

from libs.common.bus import Bus, Wired
from libs.common.errors import InvalidTransition
from libs.common.etcd_batch import BatchWriter
from libs.common.events import (
    EndpointAdded,
    EndpointNotRecovered,
    EndpointRemoved,
    EngineInfo,
    EngineRole,
    Event,
    IncidentFailed,
    IncidentOpened,
    IncidentReason,
    IncidentResolved,
    LeaseState,
    RecoverIntent,
    Step,
)
from services.controller.incident import (
    Deadlines,
    IncidentRecord,
    IncidentState,
    Trigger,
    apply,
    end_step,
    failed_step,
    start_step,
)
from services.controller.incident_trace import IncidentTracer
from services.controller.view import ClusterView


class RouteIn(NamedTuple):
    """A route-in prepared: the record once it is done (resolved) and the events to publish first (the successor's
    endpoint; a drained engine's route removed). Its end, incident.resolved, goes out only once that record is in
    etcd (`ended`, endings.py: an end is never announced that a next leader could not see)."""

    record: IncidentRecord
    events: list[Wired]


class RouteOut(NamedTuple):
    """A dispatch prepared: the record's working copy and the events to publish (route out, the intent,
    incident.opened); `lost`: the memory is gone, `cold`: the successor starts cold; `model`: the route's model;
    `at`: when the intent was made, before it is published: the freeze's start (a dc_manager may freeze and report
    `frozen_at` before the publish returns here, and a freeze cannot end before it starts: moves.py `frozen_at`)."""

    work: IncidentRecord
    events: list[Wired]
    lost: bool
    cold: bool
    model: str
    at: float


def endpoint_key(model: str, engine_id: str) -> str:
    return f"endpoints/{model}/{engine_id}"


def recovery_key(incident_id: str) -> str:
    """A cold recovery's marker: the model's endpoint is routed out and a successor is starting cold (the fallback:
    seconds to minutes, past a router's own hold). Written when the fallback starts, deleted with the route-in or at
    the incident's failed end: a router that starts (or reconciles) meanwhile learns the recovery from it, as the
    others did from `EndpointRemoved.recovery` (router sync.py). A warm takeover (tens of ms) writes none: two etcd
    operations more an incident cost ~6% of `holdfast bench controlplane`'s burst (2026-12-04)."""
    return f"recoveries/{incident_id}"


def likely_successor(view: ClusterView, rec: IncidentRecord) -> EngineInfo | None:
    """The standby the node's agent will assign (services/agent/supervision.py `pick_standby`: on the engine's GPU,
    the named one, else the one that shadows the engine, else the oldest: here only when it is the only one), if it is a ready
    standby with an endpoint: routers may send it the engine's requests before its takeover ends
    (EndpointRemoved.successor_id). None for a group (a gang's successor is a group) or when no such standby
    is known."""
    if rec.gang is not None:
        return None
    if rec.successor_hint is not None:
        named = view.engines.get(rec.successor_hint)
        cand = named if named is not None and named.node == rec.node and named.state == "standby" else None
    else:
        cand = (view.shadow_of(rec.engine_id, rec.node)
                or view.sole_standby(rec.model, rec.node, rec.version, rec.gpu))
    if cand is None or not cand.endpoint or cand.model != rec.model or cand.gpu != rec.gpu:
        return None
    return cand if rec.version is None or cand.version == rec.version else None


def serves_on(view: ClusterView, rec: IncidentRecord) -> bool:
    """Whether a failing incident's engine serves on (the record's `serves_on`): begun on purpose (a failure's engine
    is gone), it routed that engine out (a drain's stays routed until a successor is), and the view still has that
    generation active and ready, which it is not once its agent stopped it for a takeover, nor once another incident
    replaced that generation (a lost node's engine: its record stays until the node comes back). A stop the view hears of
    only later is mended then: the engine is in no incident any more, so its stop removes its route
    (engine_routes.py `stopped`)."""
    if rec.reason is IncidentReason.FAILURE or rec.move_off or Step.ROUTE_OUT not in rec.steps or not rec.endpoint:
        return False
    engine = view.engines.get(rec.engine_id)
    return (engine is not None and engine.role is EngineRole.ACTIVE and engine.state == "ready"
            and engine.generation == rec.generation and view.replaced_generation.get(rec.engine_id, -1) < rec.generation)


def successor_serves(view: ClusterView, rec: IncidentRecord) -> bool:
    """Whether a failing incident's early successor serves on (the record's `successor_serves`): recorded while the
    freeze ran (a promoted shadow, which serves without owning the leases), and in the view active, ready, of the
    model, in no incident of its own. A stop the view hears of later removes its route (engine_routes.py)."""
    sid = rec.successor_id
    if not sid or sid == rec.engine_id or not rec.successor_endpoint:
        return False
    engine = view.engines.get(sid)
    return (engine is not None and engine.role is EngineRole.ACTIVE and engine.state == "ready"
            and engine.model == rec.model and view.open_incident_for(sid) is None)


def serving_at_end(rec: IncidentRecord) -> tuple[str, str] | None:
    """The engine a failed incident routes in at its end, and its url: its own engine that serves on, or its early
    successor that serves (the record's `serves_on`, `successor_serves`); None for any other record."""
    if rec.state is not IncidentState.FAILED:
        return None
    if rec.serves_on and rec.endpoint:
        return rec.engine_id, rec.endpoint
    if rec.successor_serves and rec.successor_id and rec.successor_endpoint:
        return rec.successor_id, rec.successor_endpoint
    return None


class IncidentEvents:
    def __init__(self, bus: Bus, view: ClusterView, writer: BatchWriter, tracing: IncidentTracer,
                 deadlines: Deadlines, *, term: int = 0) -> None:
        self.bus = bus
        self.term = term  # the leader term the intents are stamped with (RecoverIntent.term)
        self.view = view
        self.writer = writer
        self.tracing = tracing
        self.deadlines = deadlines

    def route_out(self, rec: IncidentRecord) -> RouteOut:
        """The dispatch's events for `rec`'s working copy; once they are published, `routed_out` takes it on."""
        work = rec.model_copy(update={"steps": dict(rec.steps)})  # steps are replaced, never mutated
        if work.trace_parent is None:
            self.tracing.open(work)
        at = time.time()
        start_step(work, Step.ROUTE_OUT, at)
        hit = self.view.endpoint_of(work.engine_id)
        model, url = hit if hit is not None else (work.model, work.endpoint)
        # Route out beside the freeze: routers hold requests while the memory is frozen.
        lost = work.memory_lost or self._memory_gone(work)
        # moving off a drained node: the successor starts cold elsewhere; a regroup's whole group starts cold beside
        # the degraded engine's KV backup (the dc_manager's fallback path)
        cold = lost or work.move_off or work.reason is IncidentReason.REGROUP
        events = [
            self.intent(work, fallback=cold),
            self.envelope(IncidentOpened(incident_id=work.id, engine_id=work.engine_id, reason=work.reason,
                                         kind=work.kind, model=work.model, gpu=work.gpu),
                          f"{work.id}-opened", work),
        ]
        if not work.move_off:
            succ = None if cold else likely_successor(self.view, work)
            events.insert(0, self.envelope(EndpointRemoved(model=model or work.model, engine_id=work.engine_id,
                                                           url=url, reason=str(work.kind or work.reason),
                                                           incident_id=work.id, recovery=True,
                                                           live=work.reason is not IncidentReason.FAILURE,
                                                           successor_id=succ.engine_id if succ else None,
                                                           successor_url=succ.endpoint if succ else None),
                                           f"{work.id}-removed", work))
        return RouteOut(work, events, lost, cold, model or work.model, at)

    def routed_out(self, out: RouteOut) -> IncidentRecord:
        """The route-out's events are published: its endpoint key goes, and the record moves to waiting."""
        work = out.work
        if work.move_off:  # make before break: a drained engine serves until its successor does (route-in)
            end_step(work, Step.ROUTE_OUT, "skipped", time.time(), "drain: routed out when its successor is routed in")
        else:
            self.writer.delete_nowait(endpoint_key(out.model, work.engine_id))
            if out.cold:
                self.mark(work, out.model, out.at)
            end_step(work, Step.ROUTE_OUT, "done", time.time())
        trig = Trigger.DISPATCHED_FALLBACK if out.cold else Trigger.DISPATCHED
        return apply(work, trig, out.at, self.deadlines, memory_lost=out.lost)

    def route_in(self, rec: IncidentRecord) -> RouteIn:
        """Route-in's endpoint key (written behind) and events for `rec`, and the record once they are out."""
        succ, url = rec.successor_id or "", rec.successor_endpoint
        engine = self.view.engines.get(succ)
        url = url or (engine.endpoint if engine else None) or ""
        if succ and url:
            self.writer.put_nowait(endpoint_key(rec.model, succ), url)
        if rec.fallback:
            self.writer.delete_nowait(recovery_key(rec.id))  # after the successor's key, in the same batch
        new = apply(rec, Trigger.ROUTED_IN, time.time(), self.deadlines)
        events = [self.envelope(EndpointAdded(model=rec.model, engine_id=succ, url=url, incident_id=rec.id,
                                              predecessor_id=rec.engine_id), f"{rec.id}-added", rec)]
        if rec.move_off:  # the drained engine's route goes only now, after its successor's (make before break)
            hit = self.view.endpoint_of(rec.engine_id)
            model, old_url = hit if hit is not None else (rec.model, rec.endpoint)
            self.writer.delete_nowait(endpoint_key(model, rec.engine_id))
            events.append(self.envelope(EndpointRemoved(model=model, engine_id=rec.engine_id, url=old_url,
                                                        reason="drained", incident_id=rec.id),
                                        f"{rec.id}-removed", rec))
        return RouteIn(new, events)

    def mark(self, rec: IncidentRecord, model: str, at: float) -> None:
        """`rec`'s cold recovery, in etcd (`recovery_key`): at its route-out when its memory is known lost, or when
        it falls back later (pipeline.py), if it routed its engine out (a drain's move, `move_off`, does not)."""
        if not rec.move_off and Step.ROUTE_OUT in rec.steps:
            self.writer.put_nowait(recovery_key(rec.id), json.dumps({"model": model, "at": at}))

    def unmark(self, recs: list[IncidentRecord]) -> None:
        """Failed cold recoveries' markers go once their ends are announced (the routers were told). A resolved
        one's went with its route-in, in the batch that put its successor's key."""
        for rec in recs:
            if rec.state is IncidentState.FAILED and rec.fallback and not rec.move_off:
                self.writer.delete_nowait(recovery_key(rec.id))

    def route_back(self, recs: list[IncidentRecord]) -> None:
        """The endpoint keys of failed incidents' engines that serve on, put again (before their ends are published:
        a router's reconcile then finds the route its event adds)."""
        for rec in recs:
            if (serving := serving_at_end(rec)) is not None:
                self.writer.put_nowait(endpoint_key(rec.model, serving[0]), serving[1])

    def ended(self, rec: IncidentRecord) -> list[Wired]:
        """The end events of an ended record, from the record alone (a next leader rebuilds them the same: one id
        each). A failed incident that routed its engine out also tells routers no successor comes (they held the
        model's requests for one), or, its engine serving on, routes that engine back in, or its early successor
        serving, routes that one in (either ends the hold)."""
        if rec.state is IncidentState.FAILED:
            failed = [self.envelope(IncidentFailed(incident_id=rec.id, engine_id=rec.engine_id, step=failed_step(rec),
                                                   reason=rec.failure or ""), f"{rec.id}-failed", rec)]
            if (serving := serving_at_end(rec)) is not None:
                engine_id, url = serving
                failed.append(self.envelope(EndpointAdded(model=rec.model, engine_id=engine_id, url=url,
                                                          incident_id=rec.id, predecessor_id=rec.engine_id),
                                            f"{rec.id}-{'serves-on' if engine_id == rec.engine_id else 'successor-serves'}",
                                            rec))
            elif Step.ROUTE_OUT in rec.steps and not rec.move_off:
                failed.append(self.envelope(EndpointNotRecovered(model=rec.model, engine_id=rec.engine_id,
                                                                 incident_id=rec.id, reason=rec.failure or ""),
                                            f"{rec.id}-unrecovered", rec))
            return failed
        if rec.state is not IncidentState.RESOLVED:
            raise InvalidTransition(f"incident {rec.id} is {rec.state}: it has not ended")
        return [self.envelope(IncidentResolved(incident_id=rec.id, engine_id=rec.engine_id,
                                              successor_id=rec.successor_id or None, timings_ms=rec.timings_ms(),
                                              total_ms=rec.total_ms() or 0.0, fallback=rec.fallback),
                              f"{rec.id}-resolved", rec)]

    def intent(self, rec: IncidentRecord, *, fallback: bool) -> Wired:
        intent = RecoverIntent(incident_id=rec.id, engine_id=rec.engine_id, model=rec.model,
                               engine_class=rec.engine_class, gpu=rec.gpu, reason=rec.reason, kind=rec.kind,
                               memory_lost=fallback, version=rec.version, node=rec.node,
                               successor=rec.successor_hint, gang=rec.gang, term=self.term)
        # the term in the id: a new leader's intent is never dropped as a duplicate of its predecessor's (JetStream's
        # window), which the dc_manager refuses as stale (services/dc_manager/terms.py); within a term, one id
        term = f"-t{self.term}" if self.term else ""
        return self.envelope(intent, f"{rec.id}-intent-{'fallback' if fallback else 'recover'}{term}", rec)

    def envelope(self, payload: Event, key: str, rec: IncidentRecord | None) -> Wired:
        """An event with an id derived from its incident, filed under the incident's trace (its recorded
        traceparent, as it is). Wired: the envelope's JSON without its model (never read back here)."""
        return self.bus.wired(payload, id=key, traceparent=rec.trace_parent if rec else None)

    def _memory_gone(self, rec: IncidentRecord) -> bool:
        leases = self.view.leases_of(rec.engine_id)
        return bool(leases) and all(lease.state is LeaseState.RECLAIMED for lease in leases)
