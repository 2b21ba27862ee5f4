"""The chaos run's sampled invariants (bench/chaos_checks.py): pure logic, fed samples as the run would."""

from __future__ import annotations

from bench.chaos_checks import IncidentTracker, excess


def test_one_serving_engine_and_its_endpoint_is_within_one_replica() -> None:
    assert excess(1.0, "m", 1, ["e1"], ["e1"]) is None


def test_a_second_serving_engine_or_endpoint_exceeds_the_replicas() -> None:
    assert excess(1.0, "m", 1, ["e1", "e2"], ["e1"]) is not None
    assert excess(1.0, "m", 1, ["e1"], ["e1", "e3"]) is not None


def test_an_incident_that_ends_once_is_neither_unresolved_nor_ended_twice() -> None:
    t = IncidentTracker()
    t.snapshot([{"id": "i1", "state": "RUNNING"}])
    t.heard("i1", "resolved", "env-1")
    t.snapshot([{"id": "i1", "state": "RESOLVED"}])
    assert t.unresolved() == [] and t.ended_both_ways() == [] and t.reopened == []


def test_an_incident_still_running_is_unresolved() -> None:
    t = IncidentTracker()
    t.snapshot([{"id": "i1", "state": "running"}])
    assert t.unresolved() == ["i1"]


def test_an_incident_deleted_by_retention_after_it_ended_stays_ended() -> None:
    t = IncidentTracker()
    t.snapshot([{"id": "i1", "state": "resolved"}])
    t.snapshot([])
    assert t.unresolved() == [] and t.states["i1"] == "resolved"


def test_an_incident_seen_open_after_it_ended_is_ended_twice() -> None:
    t = IncidentTracker()
    t.snapshot([{"id": "i1", "state": "resolved"}])
    t.snapshot([{"id": "i1", "state": "running"}])
    assert t.reopened == ["i1"]


def test_an_incident_both_resolved_and_failed_is_ended_both_ways() -> None:
    t = IncidentTracker()
    t.heard("i1", "resolved", "env-1")
    t.heard("i1", "failed", "env-2")
    assert t.ended_both_ways() == ["i1"]


def test_one_outcome_announced_twice_is_a_duplicate_event_not_a_violation() -> None:
    t = IncidentTracker()
    t.heard("i1", "resolved", "env-1")
    t.heard("i1", "resolved", "env-2")
    t.heard("i1", "resolved", "env-2")  # the same envelope redelivered
    assert t.ended_both_ways() == [] and t.duplicate_terminal_events() == 1


def test_a_read_begun_before_the_end_was_heard_may_see_it_open_without_a_reopening() -> None:
    # the chaos run reads incidents/ while the resolved event is handled: the read began at 10, the end was heard
    # at 11, the read's result (open) comes back after; a read begun at 12 that sees it open is a reopening
    t = IncidentTracker()
    t.heard("inc-1", "resolved", "ev-1", at=11.0)
    t.snapshot([{"id": "inc-1", "state": "freezing"}], taken_at=10.0)
    assert t.reopened == [] and t.unresolved() == []
    t.snapshot([{"id": "inc-1", "state": "freezing"}], taken_at=12.0)
    assert t.reopened == ["inc-1"]
