"""The controller's view takes the leader's own incident records back from the watch without parsing them."""

from __future__ import annotations

from services.controller.incident import IncidentState, opened_record
from services.controller.view import ClusterView


def _rec(state: IncidentState = IncidentState.OPENED, **kw: object):  # type: ignore[no-untyped-def]
    return opened_record(id="inc-e1-g0", engine_id="e1", model="m", **kw).model_copy(update={"state": state})


def test_an_own_write_coming_back_byte_for_byte_is_the_very_record_written() -> None:
    view = ClusterView()
    rec = _rec()
    raw = rec.model_dump_json().encode()
    view.expect_own("incidents/inc-e1-g0", raw, rec)
    view.apply("put", "incidents/inc-e1-g0", raw)
    assert view.incidents["inc-e1-g0"] is rec
    assert view.open_by_engine["e1"] == "inc-e1-g0"
    assert not view._own  # nothing left waiting


def test_writes_sent_back_to_back_are_matched_in_order_and_an_uncommitted_one_is_dropped() -> None:
    view = ClusterView()
    first, lost, third = _rec(), _rec(IncidentState.FREEZING), _rec(IncidentState.RESOLVED)
    for r in (first, lost, third):
        view.expect_own("incidents/inc-e1-g0", r.model_dump_json().encode(), r)
    view.apply("put", "incidents/inc-e1-g0", first.model_dump_json().encode())
    assert view.incidents["inc-e1-g0"] is first
    view.apply("put", "incidents/inc-e1-g0", third.model_dump_json().encode())  # `lost` never came
    assert view.incidents["inc-e1-g0"] is third and "e1" not in view.open_by_engine
    assert not view._own


def test_a_record_someone_else_wrote_is_parsed_from_what_etcd_holds() -> None:
    view = ClusterView()
    ours, theirs = _rec(), _rec(IncidentState.FREEZING, leader="c2")
    view.expect_own("incidents/inc-e1-g0", ours.model_dump_json().encode(), ours)
    view.apply("put", "incidents/inc-e1-g0", theirs.model_dump_json().encode())
    got = view.incidents["inc-e1-g0"]
    assert got is not ours and got.leader == "c2" and got.state is IncidentState.FREEZING
