"""The leader's open incident records and the indexes derived from them (pure: no I/O)."""

from __future__ import annotations

from libs.common.events import FaultKind
from services.controller.incident import Deadlines, IncidentState, Trigger, apply, opened_record
from services.controller.open_incidents import OpenIncidents

D = Deadlines(freeze_s=1, reattach_s=2, fallback_s=3)


def test_a_successor_is_known_while_its_incident_is_open_and_forgotten_when_it_ends() -> None:
    table = OpenIncidents()
    rec = apply(opened_record(id="i", engine_id="e", opened_at=0.0), Trigger.DISPATCHED, 0.0, D)
    table.put(rec)
    assert "i" in table and not table.is_successor("s")
    early = apply(rec, Trigger.REATTACHED, 0.1, D, successor_id="s")  # promoted while freezing
    table.put(early)
    assert table.is_successor("s")
    routing = apply(early, Trigger.FROZEN, 0.2, D)
    table.put(routing)
    assert table.is_successor("s") and not table.closed_here("i")
    table.put(apply(routing, Trigger.ROUTED_IN, 0.3, D))
    assert "i" not in table and not table.is_successor("s") and table.closed_here("i") and len(table) == 0


def test_a_cold_engine_names_its_incident_only_while_that_incident_is_in_fallback() -> None:
    table = OpenIncidents()
    rec = apply(opened_record(id="i", engine_id="e", opened_at=0.0), Trigger.DISPATCHED_FALLBACK, 0.0, D)
    started = apply(rec, Trigger.COLD_STARTED, 1.0, D, cold_successor_id="cs")
    table.put(started)
    assert table.incident_of_cold("cs") == "i"
    table.put(apply(started, Trigger.REATTACHED, 2.0, D, successor_id="s"))  # a late reattach wins
    assert table.incident_of_cold("cs") is None and table.is_successor("s")
    table.drop("i")
    assert not table.is_successor("s") and "i" not in table and not table.closed_here("i")


def test_the_memory_of_closed_incidents_is_bounded_and_keeps_the_newest() -> None:
    table = OpenIncidents(closed_kept=4)
    for n in range(5):
        rec = opened_record(id=f"i{n}", engine_id="e", opened_at=0.0)
        table.put(rec.model_copy(update={"state": IncidentState.FAILED}))
    assert [table.closed_here(f"i{n}") for n in range(5)] == [False, False, True, True, True]


def test_only_a_fault_that_takes_the_memory_with_it_loses_memory() -> None:
    assert [k for k in FaultKind if k.loses_memory] == [FaultKind.GPU_FAULT, FaultKind.NODE_LOST]
