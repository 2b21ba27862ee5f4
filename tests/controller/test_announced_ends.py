"""That an end is published is recorded in a ledger per published batch, not by writing each ended record again
(announced_ends.py): an end costs one record write; retention still waits for the announcement, and a ledger goes
once every record it names is deleted."""

from __future__ import annotations

from typing import Any

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.store import Store
from services.controller.announced_ends import AnnouncedEnds, Ledger
from services.controller.incident import IncidentState, Trigger, apply, opened_record
from services.controller.view import ClusterView
from tests.controller.test_ended_incidents import FENCE, ends_heard, in_fallback_here
from tests.controller.test_open_incidents import D
from tests.controller.test_unannounced_ends import new_driver


def ended(inc_id: str, at: float) -> bytes:
    rec = apply(opened_record(id=inc_id, engine_id=f"e-{inc_id}", opened_at=0.0), Trigger.DISPATCHED_FALLBACK, 0.0, D)
    return apply(rec, Trigger.DEADLINE_MISSED, at, D).model_dump_json().encode()


def ledger(*inc_ids: str) -> bytes:
    return Ledger(incidents=list(inc_ids)).model_dump_json().encode()


async def test_an_end_costs_one_record_write_and_its_announcement_one_ledger_for_the_batch(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    await store.put(FENCE, "held")
    driver = new_driver(bus, store, settings)
    sent: list[tuple[str, Any]] = []
    driver.writer.on_send = lambda key, _value, obj: sent.append((key, obj))
    incidents = [await in_fallback_here(driver, store, f"e{i}") for i in range(3)]
    for rec, cold in incidents:
        await driver.trigger(rec.id, Trigger.SPAWNED, states=frozenset({IncidentState.FALLBACK}), successor_id=cold,
                             successor_endpoint="http://127.0.0.1:1")
    await driver.writer.flush()
    for rec, _ in incidents:
        writes = [obj for key, obj in sent if key == f"incidents/{rec.id}"]
        assert [w.state for w in writes] == [IncidentState.RESOLVED]  # written once, never again
    ledgers = [obj.incidents for key, obj in sent if key.startswith("announced/")]
    assert sorted(i for names in ledgers for i in names) == sorted(rec.id for rec, _ in incidents)
    assert len(await ends_heard(bus)) == 3
    take = await driver.log.to_take_over()
    assert take.unannounced == [] and take.spent_ledgers == []
    await driver.stop()


def test_retention_is_offered_an_ended_record_only_once_a_ledger_names_it_in_either_order() -> None:
    view = ClusterView()
    view.apply("put", "incidents/a", ended("a", 1.0))
    view.apply("put", "announced/l1", ledger("b"))  # the ledger's watch ahead of the record's
    view.apply("put", "incidents/b", ended("b", 2.0))
    assert list(view.ended) == ["b"]  # a: ended, not yet announced
    view.apply("put", "announced/l2", ledger("a"))
    assert sorted(view.ended) == ["a", "b"]


def test_a_ledger_is_spent_once_every_record_it_names_is_deleted() -> None:
    view = ClusterView()
    for inc_id in ("a", "b"):
        view.apply("put", f"incidents/{inc_id}", ended(inc_id, 1.0))
    view.apply("put", "announced/l1", ledger("a", "b"))
    view.apply("delete", "incidents/a", None)
    assert view.announced.spent == {}
    view.apply("delete", "incidents/b", None)
    assert list(view.announced.spent) == ["l1"]
    view.apply("delete", "announced/l1", None)
    assert view.announced.spent == {} and len(view.announced) == 0


def test_a_snapshot_spends_the_ledgers_whose_records_are_all_gone() -> None:
    ends = AnnouncedEnds()
    ends.add("l1", ["a", "b"], 0.0)
    ends.add("l2", ["c"], 0.0)
    ends.sweep({"b"}, 5.0)  # a and c were deleted while this view did not watch
    assert list(ends.spent) == ["l2"] and "b" in ends and "a" not in ends
    ends.deleted("b", 6.0)
    assert list(ends.spent) == ["l2", "l1"]
