"""The lease state machine and the reconciler's decisions, as pure logic (hypothesis)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.common.errors import InvalidTransition
from libs.common.events import LeaseInfo, LeaseState, Tag
from services.gpu_manager import reconciler
from services.gpu_manager.fsm import TRANSITIONS, LeaseEvent, allowed, transition
from services.gpu_manager.records import LeaseRecord


@dataclass
class Lease:
    state: LeaseState = LeaseState.ACTIVE
    epoch: int = 1

    def take(self, event: LeaseEvent) -> bool:
        try:
            out = transition(self.state, event)
        except InvalidTransition:
            return False
        self.state = out.state
        self.epoch += 1 if out.bump_epoch else 0
        return True


events = st.lists(st.sampled_from(list(LeaseEvent)), max_size=60)


@given(events)
def test_reclaimed_is_terminal(seq):
    lease = Lease()
    reclaimed = False
    for ev in seq:
        took = lease.take(ev)
        if reclaimed:
            assert not took and lease.state == LeaseState.RECLAIMED
        reclaimed = lease.state == LeaseState.RECLAIMED


@given(events)
def test_epochs_only_grow_and_grow_exactly_when_a_new_holder_becomes_active(seq):
    lease = Lease()
    for ev in seq:
        before_state, before_epoch = lease.state, lease.epoch
        took = lease.take(ev)
        assert lease.epoch >= before_epoch
        # a wake keeps its holder, and so does a thaw (the incident failed: the same owner serves on)
        new_holder = before_state in (LeaseState.ORPHANED, LeaseState.FROZEN) and ev is not LeaseEvent.THAW
        if lease.epoch > before_epoch:
            assert took and lease.state == LeaseState.ACTIVE and new_holder
        if took and lease.state == LeaseState.ACTIVE and new_holder:
            assert lease.epoch == before_epoch + 1


@given(st.sampled_from(list(LeaseState)), st.sampled_from(list(LeaseEvent)))
def test_pairs_outside_the_table_raise_and_pairs_inside_do_not(state, event):
    if allowed(state, event):
        assert transition(state, event) == TRANSITIONS[(state, event)]
    else:
        with pytest.raises(InvalidTransition):
            transition(state, event)


def test_the_table_has_the_design_transitions():
    assert transition(LeaseState.ACTIVE, LeaseEvent.OWNER_LOST).state == LeaseState.ORPHANED
    assert transition(LeaseState.ORPHANED, LeaseEvent.REATTACH).bump_epoch
    assert transition(LeaseState.ACTIVE, LeaseEvent.FREEZE).state == LeaseState.FROZEN
    assert transition(LeaseState.FROZEN, LeaseEvent.TAKEOVER).state == LeaseState.ACTIVE
    assert transition(LeaseState.ORPHANED, LeaseEvent.DEADLINE).state == LeaseState.RECLAIMED
    assert transition(LeaseState.FROZEN, LeaseEvent.DEADLINE).state == LeaseState.RECLAIMED
    assert transition(LeaseState.ACTIVE, LeaseEvent.RELEASE).state == LeaseState.RECLAIMED
    assert not allowed(LeaseState.ACTIVE, LeaseEvent.DEADLINE)  # a held lease never times out
    assert not allowed(LeaseState.ACTIVE, LeaseEvent.TAKEOVER)  # kill/freeze before transfer
    thawed = transition(LeaseState.FROZEN, LeaseEvent.THAW)
    assert thawed.state == LeaseState.ACTIVE and not thawed.bump_epoch  # back to the holder it never left
    for state in (LeaseState.ACTIVE, LeaseState.ORPHANED, LeaseState.SLEEPING, LeaseState.RECLAIMED):
        assert not allowed(state, LeaseEvent.THAW), state  # only a frozen lease thaws (an orphan's owner is gone)


def _rec(state: LeaseState, deadline: float | None, i: int) -> LeaseRecord:
    info = LeaseInfo(id=f"l{i}", node="n", gpu=0, size=1, chunk_size=1, tag=Tag.WEIGHTS, owner="e", epoch=1,
                     state=state, created_at=0, last_seen=0, deadline=deadline)
    return LeaseRecord(info=info, owner_uid=0, owner_pid=i)


@given(st.lists(st.tuples(st.sampled_from(list(LeaseState)), st.one_of(st.none(), st.floats(0, 200)),
                          st.booleans()), max_size=30), st.floats(0, 200))
def test_reconciler_orphans_dead_owners_and_reclaims_only_past_deadlines(rows, now):
    recs = [_rec(state, deadline, i) for i, (state, deadline, _) in enumerate(rows)]
    alive = {f"l{i}": a for i, (_, _, a) in enumerate(rows)}
    for lease_id, event in reconciler.plan(recs, now, lambda r: alive[r.id]):
        rec = next(r for r in recs if r.id == lease_id)
        assert allowed(rec.info.state, event)
        if event == LeaseEvent.OWNER_LOST:
            assert rec.info.state in (LeaseState.ACTIVE, LeaseState.SLEEPING) and not alive[lease_id]
        else:
            assert event == LeaseEvent.DEADLINE and rec.info.deadline is not None and rec.info.deadline <= now
    planned = {lid for lid, _ in reconciler.plan(recs, now, lambda r: alive[r.id])}
    for rec in recs:
        if rec.info.state == LeaseState.ACTIVE and alive[rec.id]:
            assert rec.id not in planned


def test_sleep_keeps_the_holder_and_a_sleeping_lease_is_never_handed_on():
    assert transition(LeaseState.ACTIVE, LeaseEvent.SLEEP).state == LeaseState.SLEEPING
    woken = transition(LeaseState.SLEEPING, LeaseEvent.WAKE)
    assert woken.state == LeaseState.ACTIVE and not woken.bump_epoch  # same holder, same addresses
    assert transition(LeaseState.SLEEPING, LeaseEvent.OWNER_LOST).state == LeaseState.RECLAIMED
    for event in (LeaseEvent.FREEZE, LeaseEvent.TAKEOVER, LeaseEvent.REATTACH, LeaseEvent.DEADLINE, LeaseEvent.SLEEP):
        assert not allowed(LeaseState.SLEEPING, event), event
    for state in (LeaseState.ORPHANED, LeaseState.FROZEN, LeaseState.RECLAIMED):
        assert not allowed(state, LeaseEvent.SLEEP) and not allowed(state, LeaseEvent.WAKE)


def test_the_reconciler_reclaims_a_dead_owners_sleeping_lease_but_not_a_live_ones():
    recs = [_rec(LeaseState.SLEEPING, None, 1), _rec(LeaseState.SLEEPING, None, 2)]
    assert reconciler.plan(recs, 0.0, lambda r: r.id == "l2") == [("l1", LeaseEvent.OWNER_LOST)]
