"""`Move`: a trigger for one incident from one message of a batch, and `next_record`, where it takes the record.
Pure: no I/O, no clock (the caller passes `now`).

Every message the pipeline consumes becomes an opening (intake.py) or moves (this module's `Move`); the driver
(pipeline.py) applies each move on its incident's latest record with `next_record`, which decides, from the
record alone, whether the move applies (a late result of an abandoned step, a fact already recorded, a cold
engine superseded do not) and which engine it leaves unneeded (stopped by the caller, best effort).

Invariants:
1. A move changes a record only through `incident.apply` (the transition table).
2. A dc_manager result acts only in the states `RESULT_RULES` names for its step and outcome.
3. A result that reports a freeze's end (`frozen_at`) on a record still freezing ends that freeze first, at a time
   between the freeze's start and `now`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from libs.common.events import Envelope, IntentResult, Step
from services.controller.incident import Deadlines, IncidentRecord, IncidentState, Trigger, apply, can

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


class Next(NamedTuple):
    """Where a move takes a record: `record` None when the move does not apply; `stop`: an engine it leaves
    unneeded, (engine id, node), for the caller to stop (a superseded cold start)."""

    record: IncidentRecord | None
    stop: tuple[str, str | None] | None = None


def result_moves(envs: list[Envelope]) -> list[Move]:
    """Intent results, each a trigger of its incident (in order: a freeze's result and its reattach's, delivered
    together, move it twice)."""
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
            if r.kv:
                changes["kv_source"] = r.kv
        moves.append(Move(i, r.incident_id, trigger, states, r.detail, r.frozen_at, changes))
    return moves


def next_record(rec: IncidentRecord, m: Move, now: float, deadlines: Deadlines, *, held: bool) -> Next:
    """The record after `m` (`held`: the incident is in this leader's open table), or `Next(None)` when `m` does
    not apply (finished, a late result of an abandoned step, a fact already recorded)."""
    cur = rec
    if m.frozen_at is not None and rec.state is S.FREEZING and m.trigger is not Trigger.FROZEN:
        cur = frozen_at(rec, m.frozen_at, now, deadlines)
    if m.trigger is Trigger.COLD_STARTED:
        news, stop = _cold_started_is_news(cur, m.changes)
        if not news:
            return Next(None, stop)
    changes = m.changes
    if m.trigger is Trigger.RANK_FAULTED:
        rank = changes["rank"]
        if rank in cur.ranks_faulted or not can(cur.state, m.trigger):
            return Next(None)  # the rank that opened it, a redelivery, or a group already recovered
        changes = {"ranks_faulted": [*cur.ranks_faulted, rank]}
    if m.trigger is Trigger.SPAWNED and (not held or cur.cold_successor_id != m.changes.get("successor_id")):
        return Next(None)  # not this leader's, or not its cold engine (superseded)
    if not can(cur.state, m.trigger) or (m.states is not None and cur.state not in m.states):
        # A freeze's end (`frozen_at`) may have routed a successor recorded early in already (incident.py,
        # invariant 5): the reattach this result reports; otherwise the move does not apply.
        return Next(cur if cur is not rec and cur.state is S.ROUTING_IN else None)
    if m.trigger is Trigger.SPAWNED:
        changes = {**changes, "successor_endpoint": changes.get("successor_endpoint") or cur.cold_successor_endpoint}
    new = apply(cur, m.trigger, now, deadlines, detail=m.detail, **changes)
    if m.trigger is Trigger.SPAWNED and m.detail and Step.FALLBACK in new.steps:
        # The cold start's own account (which copy of the weights served, how long the load took): on its step's
        # end in the timeline. `apply` keeps a detail only on failed steps.
        new.steps[Step.FALLBACK] = new.steps[Step.FALLBACK].model_copy(update={"detail": m.detail})
    if rec.state is S.FALLBACK and m.trigger is Trigger.REATTACHED and rec.cold_successor_id:
        new.cold_stopped = True  # the late reattach won: its cold engine is stopped
        return Next(new, (rec.cold_successor_id, rec.cold_successor_node))
    return Next(new)


def _cold_started_is_news(rec: IncidentRecord, cold: dict[str, Any]) -> tuple[bool, tuple[str, str | None] | None]:
    """The fallback's engine was started. Not news when already recorded; and when a reattach won before the spawn
    was even answered, that engine is not needed: to stop."""
    engine_id = cold.get("cold_successor_id")
    if not engine_id:
        return False, None
    if rec.state is not S.FALLBACK:
        unneeded = rec.successor_id != engine_id and not rec.cold_stopped
        return False, (engine_id, cold.get("cold_successor_node")) if unneeded else None
    return rec.cold_successor_id != engine_id, None


def frozen_at(rec: IncidentRecord, at: float, now: float, deadlines: Deadlines) -> IncidentRecord:
    """A record still freezing, its freeze ended at `at` (bounded by its start and now: invariant 3)."""
    started = rec.steps.get(Step.FREEZE)
    return apply(rec, Trigger.FROZEN, min(now, max(at, started.started_at if started else at)), deadlines)
