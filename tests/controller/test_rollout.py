"""The rolling upgrade's decisions (pure logic): one engine at a time, stop on failure, adopt, finish."""

from __future__ import annotations

from libs.common.events import EngineInfo, EngineRole, IncidentReason
from services.controller.incident import IncidentRecord, IncidentState, incident_id_for
from services.controller.rollout import RolloutRecord, RolloutState, advance, with_started


def _engine(engine_id: str, version: str = "1", state: str = "ready") -> EngineInfo:
    return EngineInfo(engine_id=engine_id, node="n1", model="m", engine_class="c", role=EngineRole.ACTIVE,
                      version=version, state=state)


def _incident(engine_id: str, state: IncidentState, successor: str | None = None) -> IncidentRecord:
    return IncidentRecord(id=incident_id_for(engine_id, 0, IncidentReason.HOT_UPGRADE), engine_id=engine_id,
                          reason=IncidentReason.HOT_UPGRADE, state=state, successor_id=successor,
                          failure="reattach missed its deadline" if state is IncidentState.FAILED else None)


def test_the_first_engine_is_started_and_the_second_waits_for_its_incident() -> None:
    engines = {e.engine_id: e for e in (_engine("a"), _engine("b"))}
    rec = RolloutRecord(engine_class="c", version="2")
    d = advance(rec, engines, {}, {}, 1.0)
    assert d.start is not None and d.start.engine_id == "a"
    rec = with_started(d.record, d.start, 1.0)
    inc = _incident("a", IncidentState.REATTACHING)
    d = advance(rec, engines, {inc.id: inc}, {"a": inc.id}, 2.0)
    assert d.start is None and not d.changed


def test_a_resolved_incident_lets_the_next_engine_go_and_the_last_one_finishes_the_roll_out() -> None:
    engines = {e.engine_id: e for e in (_engine("a"), _engine("b"))}
    rec = with_started(RolloutRecord(engine_class="c", version="2"), engines["a"], 1.0)
    done_a = _incident("a", IncidentState.RESOLVED, successor="a2")
    engines["a2"] = _engine("a2", version="2")
    d = advance(rec, engines, {done_a.id: done_a}, {}, 2.0)
    assert d.changed and d.start is not None and d.start.engine_id == "b"
    assert d.record.steps[0].state == "done" and d.record.steps[0].successor_id == "a2"
    rec = with_started(d.record, d.start, 2.0)
    done_b = _incident("b", IncidentState.RESOLVED, successor="b2")
    d = advance(rec, engines, {done_a.id: done_a, done_b.id: done_b}, {}, 3.0)
    assert d.record.state is RolloutState.DONE and d.start is None


def test_a_failed_incident_stops_the_roll_out_and_says_why() -> None:
    engines = {e.engine_id: e for e in (_engine("a"), _engine("b"))}
    rec = with_started(RolloutRecord(engine_class="c", version="2"), engines["a"], 1.0)
    failed = _incident("a", IncidentState.FAILED)
    d = advance(rec, engines, {failed.id: failed}, {}, 2.0)
    assert d.record.state is RolloutState.FAILED and d.start is None
    assert "engine a" in (d.record.failure or "") and "reattach missed its deadline" in (d.record.failure or "")
    assert advance(d.record, engines, {failed.id: failed}, {}, 3.0).start is None  # stopped for good


def test_an_engine_in_a_failure_incident_is_waited_for_and_an_unrecorded_upgrade_incident_is_adopted() -> None:
    engines = {"a": _engine("a")}
    rec = RolloutRecord(engine_class="c", version="2")
    d = advance(rec, engines, {}, {"a": "inc-a-g0"}, 1.0)
    assert d.start is None and d.record.state is RolloutState.RUNNING
    ours = _incident("a", IncidentState.FREEZING)
    d = advance(rec, engines, {ours.id: ours}, {"a": ours.id}, 2.0)
    assert d.start is None and [s.incident_id for s in d.record.steps] == [ours.id]
