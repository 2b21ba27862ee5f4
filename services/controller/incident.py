"""The incident state machine and record: pure data and functions, no I/O.

An incident is one failed engine generation (or a failover started on purpose) on its way back to
serving. Its record lives in etcd at `incidents/<id>`; the record is the only memory of progress, so a
new leader resumes from it. The machine is a frozen table; `apply()` is the one way to change a record.

Invariants:
1. One incident per failed engine generation: the id is derived from (engine id, generation, reason).
2. States only move along `TRANSITIONS`; terminal states (resolved, failed) never change again: an ended record
   is final. It carries the mark `end_unannounced` (set by the transition that ends it); that its end event was
   published is recorded beside it, in a ledger (the leader's `endings.py`, `announced_ends.py`).
3. A record in state S says that the entry action of S (the intent sent, the endpoint added...) is done.
4. Every step that started has a start time; every step that ended has an end time >= its start.
5. A successor known while still freezing (a shadow promoted while the freeze runs) is in the record
   (`successor_id`, state freezing); it is routed in once the freeze ends, never before: the incident
   resolves at route-in, and its memory must be frozen by then.
6. A transition to the same state (a fact recorded on the way: an early successor, the cold engine started)
   changes no step and no deadline.
7. One incident per tensor-parallel group and generation: its id is the group's (rank 0's engine id), whichever
   rank faulted; a further rank's fault is `rank_faulted` (recorded in `ranks_faulted`), never a second incident.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from pydantic import BaseModel, ConfigDict, Field

from libs.common.errors import InvalidTransition
from libs.common.events import FaultKind, IncidentReason, Step
from libs.common.ids import incident_id


class IncidentState(StrEnum):
    OPENED = "opened"  # recorded; route-out and the recover intent not yet sent
    FREEZING = "freezing"  # intent sent; waiting for the freeze
    REATTACHING = "reattaching"  # memory frozen; waiting for the successor
    FALLBACK = "fallback"  # cold start of the engine in progress
    ROUTING_IN = "routing_in"  # successor known; endpoint not yet announced
    RESOLVED = "resolved"
    FAILED = "failed"


class Trigger(StrEnum):
    DISPATCHED = "dispatched"  # endpoint removed, recover intent sent
    DISPATCHED_FALLBACK = "dispatched_fallback"  # memory known lost at opening: cold start intent sent
    FROZEN = "frozen"
    REATTACHED = "reattached"  # from freezing: the successor serves early, recorded; routed in once frozen
    COLD_STARTED = "cold_started"  # the fallback's engine was started (not ready yet): recorded
    SPAWNED = "spawned"  # the cold-started successor reported ready
    STEP_FAILED = "step_failed"
    DEADLINE_MISSED = "deadline_missed"
    MEMORY_LOST = "memory_lost"
    ROUTED_IN = "routed_in"
    RANK_FAULTED = "rank_faulted"  # another rank of the incident's TP group faulted: it joins, recorded (invariant 7)


S, T = IncidentState, Trigger
TERMINAL = frozenset({S.RESOLVED, S.FAILED})
WAITING = frozenset({S.FREEZING, S.REATTACHING, S.FALLBACK})

TRANSITIONS: Mapping[tuple[IncidentState, Trigger], IncidentState] = MappingProxyType({
    (S.OPENED, T.DISPATCHED): S.FREEZING,
    (S.OPENED, T.DISPATCHED_FALLBACK): S.FALLBACK,
    (S.FREEZING, T.FROZEN): S.REATTACHING,  # with a successor recorded early, on at once to routing_in
    (S.FREEZING, T.REATTACHED): S.FREEZING,  # invariant 5: recorded, waits for the freeze
    (S.REATTACHING, T.REATTACHED): S.ROUTING_IN,
    (S.FREEZING, T.STEP_FAILED): S.FALLBACK,
    (S.FREEZING, T.DEADLINE_MISSED): S.FALLBACK,
    (S.FREEZING, T.MEMORY_LOST): S.FALLBACK,
    (S.REATTACHING, T.STEP_FAILED): S.FALLBACK,
    (S.REATTACHING, T.DEADLINE_MISSED): S.FALLBACK,
    (S.REATTACHING, T.MEMORY_LOST): S.FALLBACK,
    (S.FALLBACK, T.COLD_STARTED): S.FALLBACK,  # which engine is starting, recorded (routed in when ready)
    (S.FALLBACK, T.SPAWNED): S.ROUTING_IN,  # the cold-started engine reported ready
    (S.FALLBACK, T.REATTACHED): S.ROUTING_IN,  # a late reattach wins: it holds the memory, no reload
    (S.FALLBACK, T.STEP_FAILED): S.FAILED,
    (S.FALLBACK, T.DEADLINE_MISSED): S.FAILED,
    (S.ROUTING_IN, T.ROUTED_IN): S.RESOLVED,
    # Invariant 7: a rank's fault joins its group's open incident, in whatever state it is.
    **{(state, T.RANK_FAULTED): state for state in IncidentState if state not in TERMINAL},
})
# Invariant 2, as a rule of the table: no row leaves an ended state. A late result, a redelivered event, a step
# that ran on after the end: whatever the trigger, an ended incident takes none (`transition` says so by name).
if any(state in TERMINAL for state, _ in TRANSITIONS):
    raise AssertionError("incident.py: a transition leaves an ended state")

# The step a state is waiting on (its start is the state's entry, its end the state's exit).
STEP_OF: Mapping[IncidentState, Step] = MappingProxyType({
    S.FREEZING: Step.FREEZE,
    S.REATTACHING: Step.REATTACH,
    S.FALLBACK: Step.FALLBACK,
    S.ROUTING_IN: Step.ROUTE_IN,
})


def transition(state: IncidentState, trigger: Trigger) -> IncidentState:
    if state in TERMINAL:
        raise InvalidTransition(f"incident ended ({state}): it never changes again, {trigger} ignored")
    try:
        return TRANSITIONS[(state, trigger)]
    except KeyError:
        raise InvalidTransition(f"incident in state {state} cannot take {trigger}") from None


def can(state: IncidentState, trigger: Trigger) -> bool:
    return (state, trigger) in TRANSITIONS


@dataclass(frozen=True)
class Deadlines:
    freeze_s: float = 5.0
    reattach_s: float = 30.0
    fallback_s: float = 300.0

    def for_state(self, state: IncidentState) -> float | None:
        if state is S.FREEZING:  # not a dict built per call (four times per incident)
            return self.freeze_s
        if state is S.REATTACHING:
            return self.reattach_s
        return self.fallback_s if state is S.FALLBACK else None


def incident_id_for(engine_id: str, generation: int, reason: IncidentReason = IncidentReason.FAILURE) -> str:
    """Invariant 1: the same failed generation always maps to the same id (subject- and URL-safe)."""
    short = {IncidentReason.FAILURE: "inc", IncidentReason.MANUAL_FAILOVER: "mf", IncidentReason.HOT_UPGRADE: "up",
             IncidentReason.REGROUP: "rg"}[reason]
    return incident_id(short, engine_id, generation)


class StepRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    status: str = "started"  # started, done, failed, skipped
    started_at: float
    ended_at: float | None = None
    detail: str = ""

    @property
    def duration_ms(self) -> float | None:
        return None if self.ended_at is None else round((self.ended_at - self.started_at) * 1000.0, 3)


class IncidentRecord(BaseModel):
    """`incidents/<id>` in etcd. Times are epoch seconds."""

    model_config = ConfigDict(extra="ignore")

    id: str
    engine_id: str
    model: str = ""
    engine_class: str = "default"
    generation: int = 0
    node: str | None = None
    gpu: int = 0
    endpoint: str | None = None  # the failed engine's URL (routers drop it)
    reason: IncidentReason = IncidentReason.FAILURE
    kind: FaultKind | None = None
    version: str | None = None  # hot upgrade: the successor's version
    successor_hint: str | None = None  # a standby named by the operator
    gang: str | None = None  # a TP group's gang: frozen (FreezeGang) and taken over whole by a successor group
    ranks_faulted: list[str] = Field(default_factory=list)  # a TP group: the ranks whose faults it holds (invariant 7)
    move_off: bool = False  # a node drain: cold start on another node, then stop this engine (memory stays put)
    state: IncidentState = S.OPENED
    opened_at: float = Field(default_factory=time.time)
    died_at: float | None = None
    updated_at: float = Field(default_factory=time.time)
    deadline: float | None = None
    memory_lost: bool = False
    fallback: bool = False
    steps: dict[Step, StepRecord] = Field(default_factory=dict)
    successor_id: str | None = None
    successor_endpoint: str | None = None
    cold_successor_id: str | None = None  # the fallback's spawned engine (routed in once it is ready)
    cold_successor_endpoint: str | None = None
    cold_successor_node: str | None = None
    cold_stopped: bool = False  # a late reattach superseded the cold start and its engine was stopped
    kv_source: str | None = None  # the reattach's successor's KV, when not the handed-on cache ("KV from host backup")
    failure: str | None = None
    # Failed, begun on purpose (a manual failover, an upgrade: not a failure), with its engine still serving as it
    # ended (nothing took its memory over or stopped it): routed back in and its memory thawed (routes.py `ended`),
    # where a failure's engine is gone. Decided once, as the incident fails; a next leader's end says the same.
    serves_on: bool = False
    # Failed with its early successor (a shadow promoted while the freeze ran: `successor_id`) active and ready in
    # the view: its freeze failed (the node's gpu_manager stalled or restarted) and its cold start was refused, the
    # successor filling the model's slot. Routed in at the end (routes.py `ended`), where it served on with no
    # route for good (probe of 2026-12-07). Decided once, as the incident fails.
    successor_serves: bool = False
    # Ended, and its end (incident.resolved / incident.failed) announced only if a ledger names it (invariant 2,
    # announced_ends.py): the record is written first, the end announced after, then the ledger. A leader finding it
    # set and named by no ledger announces it. (Records of earlier versions had it taken off instead.)
    end_unannounced: bool = False
    trace_parent: str | None = None
    leader: str = ""  # the controller that last wrote the record

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def timings_ms(self) -> dict[str, float]:
        out = {str(step): ms for step, rec in self.steps.items() if (ms := rec.duration_ms) is not None}
        total = self.total_ms()
        if total is not None:
            out["total"] = total
        return out

    def total_ms(self) -> float | None:
        route_in = self.steps.get(Step.ROUTE_IN)
        if route_in is None or route_in.ended_at is None:
            return None
        start = self.died_at if self.died_at is not None else self.opened_at
        return round((route_in.ended_at - start) * 1000.0, 3)

    def timeline(self) -> list[dict[str, object]]:
        """Every recorded start and end, in time order (what `GET /v1/incidents/{id}` shows)."""
        rows: list[dict[str, object]] = []
        for step, rec in self.steps.items():
            rows.append({"at": rec.started_at, "step": str(step), "event": "started", "detail": ""})
            if rec.ended_at is not None:
                rows.append({"at": rec.ended_at, "step": str(step), "event": rec.status, "detail": rec.detail})
        rows.sort(key=lambda r: (r["at"], r["event"] == "started"))  # type: ignore[arg-type,return-value]
        return rows


def opened_record(**fields: object) -> IncidentRecord:
    """A new record: the detect step spans the death (when known) to now."""
    rec = IncidentRecord(**fields)  # type: ignore[arg-type]
    start = rec.died_at if rec.died_at is not None else rec.opened_at
    rec.steps[Step.DETECT] = StepRecord(status="done", started_at=min(start, rec.opened_at), ended_at=rec.opened_at)
    return rec


def failed_step(rec: IncidentRecord) -> Step:
    """The step a failed incident failed in: the last recorded failed (every row into failed leaves fallback,
    whose step `apply` ends failed)."""
    failed = [(s.ended_at or s.started_at, step) for step, s in rec.steps.items() if s.status == "failed"]
    return max(failed)[1] if failed else Step.FALLBACK


def end_step(rec: IncidentRecord, step: Step, status: str, now: float, detail: str = "") -> None:
    cur = rec.steps.get(step)
    if cur is None:
        cur = StepRecord(started_at=now)
    if cur.ended_at is None:
        rec.steps[step] = cur.model_copy(update={"status": status, "ended_at": max(now, cur.started_at), "detail": detail})


def start_step(rec: IncidentRecord, step: Step, now: float) -> None:
    if step not in rec.steps:
        rec.steps[step] = StepRecord(started_at=now)


def apply(rec: IncidentRecord, trigger: Trigger, now: float, deadlines: Deadlines, *, detail: str = "",
          **changes: object) -> IncidentRecord:
    """The one way a record moves (invariant 2): a new record in the next state, steps bookkept."""
    new_state = transition(rec.state, trigger)
    if new_state is rec.state:  # invariant 6: a fact recorded, no step moves
        return rec.model_copy(update={**changes, "updated_at": now, "steps": dict(rec.steps)})
    limit = deadlines.for_state(new_state)
    # Shallow, with its own steps dict: step records are replaced (model_copy), never mutated in place. Every
    # field the new state sets is in this one copy's update (an attribute set on a model afterwards costs
    # pydantic's __setattr__ each).
    update = {**changes, "state": new_state, "updated_at": now, "steps": dict(rec.steps),
              "deadline": None if limit is None else now + limit}
    if new_state is S.FALLBACK:
        update["fallback"] = True
    if new_state is S.FAILED:
        update["failure"] = detail or str(trigger)
    if new_state in TERMINAL:
        update["end_unannounced"] = True
    out = rec.model_copy(update=update)
    old_step = STEP_OF.get(rec.state)
    if old_step is not None:
        ok = trigger in (T.FROZEN, T.REATTACHED, T.SPAWNED, T.ROUTED_IN)
        end_step(out, old_step, "done" if ok else "failed", now, detail if not ok else "")
    if trigger is T.REATTACHED:
        # From FREEZING it is a self-transition (above): invariant 5. From FALLBACK: the reattach was late but holds the memory; the cold start is superseded.
        end_step(out, Step.REATTACH, "done", now)
        if rec.state is S.FALLBACK:
            late = out.steps.get(Step.REATTACH)
            if late is not None:  # it was recorded failed at its deadline; it did succeed, later
                out.steps[Step.REATTACH] = late.model_copy(update={"status": "done", "ended_at": max(now, late.started_at),
                                                                   "detail": "succeeded after its deadline"})
            out.steps[Step.FALLBACK] = out.steps[Step.FALLBACK].model_copy(
                update={"status": "skipped", "detail": "superseded by a late reattach"})
    if trigger is T.REATTACHED and out.kv_source:  # the timeline says where the successor's KV came from
        done = out.steps.get(Step.REATTACH)
        if done is not None and done.status == "done" and not done.detail:
            out.steps[Step.REATTACH] = done.model_copy(update={"detail": out.kv_source})
    if trigger is T.SPAWNED:
        end_step(out, Step.FALLBACK, "done", now)
    new_step = STEP_OF.get(new_state)
    if new_step is not None:
        start_step(out, new_step, now)
    if new_state is S.REATTACHING and out.successor_id:  # invariant 5: frozen now, the early successor goes in
        return apply(out, T.REATTACHED, now, deadlines)
    return out
