"""The incident state machine and record (pure: no I/O)."""

from __future__ import annotations

import pytest

from libs.common.errors import InvalidTransition
from libs.common.events import IncidentReason, Step
from services.controller.incident import (
    TERMINAL,
    TRANSITIONS,
    Deadlines,
    IncidentState,
    Trigger,
    apply,
    incident_id_for,
    opened_record,
    transition,
)

D = Deadlines(freeze_s=1, reattach_s=2, fallback_s=3)


def test_one_failed_generation_always_maps_to_the_same_incident_id() -> None:
    assert incident_id_for("e.1", 3) == incident_id_for("e.1", 3) == "inc-e_1-g3"
    assert incident_id_for("e", 3) != incident_id_for("e", 4)
    assert incident_id_for("e", 3, IncidentReason.HOT_UPGRADE) != incident_id_for("e", 3)


def test_terminal_states_take_no_trigger() -> None:
    for state in TERMINAL:
        for trig in Trigger:
            with pytest.raises(InvalidTransition):
                transition(state, trig)
    assert all(src not in TERMINAL for src, _ in TRANSITIONS)


def test_the_happy_path_records_every_step_with_its_times() -> None:
    rec = opened_record(id="i", engine_id="e", died_at=99.0, opened_at=100.0)
    rec = apply(rec, Trigger.DISPATCHED, 100.5, D)
    assert rec.state is IncidentState.FREEZING and rec.deadline == 101.5
    rec = apply(rec, Trigger.FROZEN, 101.0, D)
    assert rec.state is IncidentState.REATTACHING and rec.deadline == 103.0
    rec = apply(rec, Trigger.REATTACHED, 101.25, D, successor_id="s")
    rec = apply(rec, Trigger.ROUTED_IN, 101.5, D)
    assert rec.state is IncidentState.RESOLVED and rec.deadline is None and rec.successor_id == "s"
    t = rec.timings_ms()
    assert t["detect"] == 1000.0 and t["freeze"] == 500.0 and t["reattach"] == 250.0 and t["total"] == 2500.0
    times = [row["at"] for row in rec.timeline()]
    assert times == sorted(times)


def test_a_missed_deadline_takes_the_fallback_and_a_failed_fallback_fails_the_incident() -> None:
    rec = apply(opened_record(id="i", engine_id="e", opened_at=0.0), Trigger.DISPATCHED, 0.0, D)
    rec = apply(rec, Trigger.DEADLINE_MISSED, 1.5, D, detail="freeze missed its deadline")
    assert rec.state is IncidentState.FALLBACK and rec.fallback and rec.steps[Step.FREEZE].status == "failed"
    rec = apply(rec, Trigger.STEP_FAILED, 2.0, D, detail="no gpu")
    assert rec.state is IncidentState.FAILED and rec.failure == "no gpu"
    assert rec.steps[Step.FALLBACK].status == "failed" and rec.steps[Step.FALLBACK].detail == "no gpu"


def test_a_successor_is_never_routed_in_before_the_freeze_ends() -> None:
    rec = apply(opened_record(id="i", engine_id="e", opened_at=0.0), Trigger.DISPATCHED, 0.0, D)
    # A shadow promoted while the freeze runs is recorded, and waits for it: no step moves, no deadline changes.
    early = apply(rec, Trigger.REATTACHED, 0.01, D, successor_id="s", successor_endpoint="http://s")
    assert early.state is IncidentState.FREEZING and early.successor_id == "s"
    assert early.deadline == rec.deadline and early.steps == rec.steps and early.updated_at == 0.01
    # The freeze ends: the recorded successor goes on to route-in at once.
    frozen = apply(early, Trigger.FROZEN, 0.02, D)
    assert frozen.state is IncidentState.ROUTING_IN and frozen.successor_endpoint == "http://s"
    assert frozen.steps[Step.FREEZE].status == "done" and frozen.steps[Step.REATTACH].status == "done"
    # Without one, the freeze's end waits for the reattach as before.
    rec = apply(apply(rec, Trigger.FROZEN, 0.02, D), Trigger.REATTACHED, 0.02, D)
    assert rec.state is IncidentState.ROUTING_IN
    assert rec.steps[Step.FREEZE].status == "done" and rec.steps[Step.REATTACH].status == "done"


def test_the_fallbacks_cold_engine_is_recorded_without_moving_a_step() -> None:
    rec = apply(opened_record(id="i", engine_id="e", opened_at=0.0), Trigger.DISPATCHED_FALLBACK, 0.0, D)
    started = apply(rec, Trigger.COLD_STARTED, 1.0, D, cold_successor_id="cs", cold_successor_node="n")
    assert started.state is IncidentState.FALLBACK and started.cold_successor_id == "cs"
    assert started.deadline == rec.deadline and started.steps == rec.steps
    ready = apply(started, Trigger.SPAWNED, 2.0, D, successor_id="cs")
    assert ready.state is IncidentState.ROUTING_IN and ready.steps[Step.FALLBACK].status == "done"


def test_memory_known_lost_at_opening_goes_straight_to_the_cold_start() -> None:
    rec = apply(opened_record(id="i", engine_id="e", opened_at=0.0), Trigger.DISPATCHED_FALLBACK, 0.0, D)
    assert rec.state is IncidentState.FALLBACK and rec.deadline == 3.0 and Step.FREEZE not in rec.steps
