"""Crash-loop backoff and the desired-state moves of a hot upgrade (pure logic)."""

from __future__ import annotations

from libs.common.events import EngineRole
from services.agent import supervision
from services.agent.backoff import BackoffPolicy, Backoffs
from services.agent.engines import EngineRecord, State
from tests.agent.conftest import pattern_spec

POLICY = BackoffPolicy(base_s=0.5, max_s=4.0, reset_s=10.0)


def test_the_first_failure_is_replaced_at_once_and_the_next_ones_wait_twice_as_long_up_to_the_cap() -> None:
    b = Backoffs(POLICY)
    delays = [b.failed("k", now=float(i), uptime_s=0.1) for i in range(7)]
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_replacement_may_start_only_once_the_delay_has_passed() -> None:
    b = Backoffs(POLICY)
    b.failed("k", 100.0, 0.1)
    b.failed("k", 101.0, 0.1)  # second in a row: 0.5 s
    assert not b.may_start("k", 101.4) and b.retry_in("k", 101.25) == 0.25
    assert b.may_start("k", 101.5) and b.may_start("other", 0.0)


def test_an_engine_that_stayed_up_long_enough_starts_the_count_over() -> None:
    b = Backoffs(POLICY)
    for i in range(4):
        b.failed("k", float(i), 0.1)
    assert b.failed("k", 50.0, uptime_s=10.0) == 0.0 and b.by_key["k"].failures == 1


def test_a_running_engine_clears_the_loop_after_the_reset_time_but_not_before() -> None:
    b = Backoffs(POLICY)
    b.failed("k", 0.0, 0.1)
    b.failed("k", 1.0, 0.1)
    b.note_up("k", now=5.0, up_since=2.0)
    assert "k" in b.by_key
    b.note_up("k", now=12.0, up_since=2.0)
    assert "k" not in b.by_key


def _rec(engine_id: str, key: str, role: EngineRole, state: State, spawned: float = 0.0) -> EngineRecord:
    return EngineRecord(engine_id=engine_id, model="pattern-m", engine_class="pattern", role=role, spec_key=key,
                        state=state, spawned_mono=spawned)


def test_the_plan_holds_a_crash_looping_spec_back_until_its_backoff_ends() -> None:
    spec = pattern_spec(replicas=1, standbys=0)
    key = supervision.spec_key(spec)
    b = Backoffs(POLICY)
    b.failed(key, 10.0, 0.1)
    b.failed(key, 11.0, 0.1)
    held = supervision.plan({key: spec}, [], 11.2, takeover_wait_s=0.0, backoffs=b)
    assert held.start == [] and held.held == [key]
    assert supervision.plan({key: spec}, [], 11.6, takeover_wait_s=0.0, backoffs=b).start == [(key, EngineRole.ACTIVE)]


def test_standbys_beyond_a_lowered_spec_are_stopped_newest_first_and_a_handed_over_slot_is_kept() -> None:
    spec = pattern_spec(replicas=1, standbys=1)
    key = supervision.spec_key(spec)
    records = [_rec("pred", key, EngineRole.ACTIVE, State.STOPPED), _rec("s-old", key, EngineRole.STANDBY, State.STANDBY, 1.0),
               _rec("s-new", key, EngineRole.STANDBY, State.STANDBY, 2.0)]
    records[0].handing_over = True
    p = supervision.plan({key: spec}, records, 5.0, takeover_wait_s=60.0)
    assert p.stop == ["s-new"] and p.start == []


def test_a_hot_upgrade_moves_one_replica_and_the_last_one_takes_the_standbys_along() -> None:
    old, new = pattern_spec(replicas=2, standbys=1, version="1"), pattern_spec(replicas=0, standbys=0, version="2")
    old, new = supervision.move_replica(old, new)
    assert (old.replicas, old.standbys, new.replicas, new.standbys) == (1, 1, 1, 0)
    old, new = supervision.move_replica(old, new)
    assert (old.replicas, old.standbys, new.replicas, new.standbys) == (0, 0, 2, 1)
