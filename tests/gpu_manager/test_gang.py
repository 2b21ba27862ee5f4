"""Gangs (pure): a tensor-parallel engine's ranks' leases frozen, taken over and reclaimed together, all or nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.common.errors import InvalidTransition
from libs.common.events import LeaseInfo, LeaseState, Tag
from services.gpu_manager import reconciler
from services.gpu_manager.fsm import LeaseEvent, transition
from services.gpu_manager.gang import (
    Gang,
    PartialGang,
    StaleGang,
    after_degraded,
    after_takeover,
    degradable,
    plan,
    plan_degraded,
    plan_freeze_degraded,
)
from services.gpu_manager.records import LeaseRecord

A, F, R = LeaseState.ACTIVE, LeaseState.FROZEN, LeaseState.RECLAIMED


def lease(rank: int, tag: Tag, state: LeaseState = A, epoch: int = 1, owner: str | None = None) -> LeaseInfo:
    return LeaseInfo(id=f"r{rank}-{tag.value}", node="n", gpu=rank, size=1, chunk_size=1, tag=tag,
                     owner=owner or f"tp-r{rank}", epoch=epoch, state=state, created_at=0.0, last_seen=0.0)


def gang_of(n: int = 2, state: LeaseState = A) -> tuple[Gang, list[LeaseInfo]]:
    leases = [lease(r, t, state) for r in range(n) for t in (Tag.WEIGHTS, Tag.KV_CACHE)]
    return Gang("g1", n, {r: f"tp-r{r}" for r in range(n)}, {i.id: i.epoch for i in leases}), leases


def test_a_whole_gang_is_frozen_every_lease_of_every_rank() -> None:
    gang, leases = gang_of(2)
    moves = plan(gang, leases, LeaseEvent.FREEZE)
    assert sorted(m.lease_id for m in moves) == sorted(i.id for i in leases)
    assert {m.rank for m in moves} == {0, 1}


def test_a_gang_missing_a_ranks_leases_or_its_weights_is_partial_and_nothing_moves() -> None:
    gang, leases = gang_of(2)
    with pytest.raises(PartialGang, match="rank 1") as e:
        plan(gang, [i for i in leases if not i.id.startswith("r1")], LeaseEvent.FREEZE)
    assert e.value.code == "partial_gang"
    with pytest.raises(PartialGang, match="no weights"):
        plan(gang, [i for i in leases if i.id != "r1-weights"], LeaseEvent.FREEZE)
    with pytest.raises(PartialGang, match="not in the gang"):
        plan(gang, [*leases, lease(0, Tag.OTHER)], LeaseEvent.FREEZE)
    reclaimed = [i.model_copy(update={"state": R}) if i.id == "r0-kv_cache" else i for i in leases]
    with pytest.raises(PartialGang, match="rank 0|gone"):
        plan(gang, reclaimed, LeaseEvent.FREEZE)


def test_a_rank_restarted_alone_since_the_gangs_commit_is_stale() -> None:
    gang, leases = gang_of(2)
    moved = [i.model_copy(update={"epoch": 2}) if i.id == "r1-weights" else i for i in leases]
    with pytest.raises(StaleGang, match="epoch 2") as e:
        plan(gang, moved, LeaseEvent.FREEZE)
    assert e.value.code == "stale_gang"


def test_a_takeover_moves_every_rank_to_its_successor_rank_and_bumps_the_generation() -> None:
    gang, leases = gang_of(2, F)
    tokens = {i.id: "tok" for i in leases}
    succ = {0: "new-r0", 1: "new-r1"}
    moves = plan(gang, leases, LeaseEvent.TAKEOVER, successors=succ, generation=1, token_of=tokens)
    assert {(m.lease_id, m.new_owner) for m in moves} == {(i.id, succ[int(i.id[1])]) for i in leases}
    nxt = after_takeover(gang, moves, leases)
    assert nxt.generation == 2 and dict(nxt.owners) == succ and set(nxt.epochs.values()) == {2}


def test_a_takeover_is_refused_whole_when_the_group_is_partial_stale_or_not_all_frozen() -> None:
    gang, leases = gang_of(2, F)
    tokens = {i.id: "tok" for i in leases}
    with pytest.raises(PartialGang, match="successor group"):
        plan(gang, leases, LeaseEvent.TAKEOVER, successors={0: "new-r0"}, generation=1, token_of=tokens)
    with pytest.raises(StaleGang, match="generation"):
        plan(gang, leases, LeaseEvent.TAKEOVER, successors={0: "a", 1: "b"}, generation=0, token_of=tokens)
    with pytest.raises(StaleGang, match="tokens"):
        plan(gang, leases, LeaseEvent.TAKEOVER, successors={0: "a", 1: "b"}, generation=1,
             token_of={**tokens, "r1-weights": "other"})
    half = [i.model_copy(update={"state": A}) if i.id.startswith("r1") else i for i in leases]
    with pytest.raises(PartialGang, match="not frozen"):
        plan(gang, half, LeaseEvent.TAKEOVER, successors={0: "a", 1: "b"}, generation=1, token_of=tokens)


def test_one_move_the_state_machine_refuses_refuses_the_whole_gang() -> None:
    gang, leases = gang_of(2, F)
    active = [i.model_copy(update={"state": A}) if i.id == "r1-kv_cache" else i for i in leases]
    with pytest.raises(InvalidTransition):
        plan(gang, active, LeaseEvent.RECLAIM)  # an ACTIVE lease takes no plain reclaim
    assert len(plan(gang, active, LeaseEvent.FORCE_RECLAIM)) == 4


# ------------------------------------------------------------ the reconciler's deadlines, per gang (reconciler rule 5)

def _row(info: LeaseInfo, deadline: float | None, pid: int) -> LeaseRecord:
    return LeaseRecord(info=info.model_copy(update={"deadline": deadline}), owner_uid=0, owner_pid=pid)


HELD_STATES = [LeaseState.ACTIVE, LeaseState.ORPHANED, LeaseState.FROZEN, LeaseState.SLEEPING]


@given(st.lists(st.tuples(st.sampled_from(HELD_STATES), st.one_of(st.none(), st.floats(0, 100)), st.booleans()),
                min_size=4, max_size=4), st.floats(0, 100))
def test_the_reconciler_reclaims_a_gangs_leases_all_in_one_pass_once_each_is_due_or_none(rows, now) -> None:
    gang, leases = gang_of(2)
    recs = [_row(i.model_copy(update={"state": s}), d, pid) for pid, (i, (s, d, _)) in enumerate(zip(leases, rows, strict=True))]
    alive = {r.id: a for r, (_, _, a) in zip(recs, rows, strict=True)}
    planned = dict(reconciler.plan(recs, now, lambda r: alive[r.id], [gang]))
    reclaims = {r.id for r in recs if r.id in planned and transition(r.info.state, planned[r.id]).state == R}
    due = [(r.info.state in (LeaseState.ORPHANED, LeaseState.FROZEN) and r.info.deadline is not None
            and r.info.deadline <= now) or (r.info.state == LeaseState.SLEEPING and not alive[r.id]) for r in recs]
    assert reclaims == ({r.id for r in recs} if all(due) else set())
    for r in recs:  # an engine's death is still seen at once, lease by lease (orphaning frees nothing)
        if r.info.state == LeaseState.ACTIVE and not alive[r.id]:
            assert planned[r.id] == LeaseEvent.OWNER_LOST


def test_a_ranks_lease_past_its_deadline_waits_for_the_gangs_last_and_a_lone_lease_does_not() -> None:
    gang, leases = gang_of(2)
    o = LeaseState.ORPHANED
    recs = [_row(i.model_copy(update={"state": o}), 10.0 if i.id.startswith("r1") else 12.0, n)
            for n, i in enumerate(leases)]
    lone = _row(lease(5, Tag.WEIGHTS, o, owner="other"), 10.0, 9)
    assert reconciler.plan([*recs, lone], 11.0, lambda r: False, [gang]) == [(lone.id, LeaseEvent.DEADLINE)]
    assert sorted(reconciler.plan(recs, 12.0, lambda r: False, [gang])) == sorted(
        (r.id, LeaseEvent.DEADLINE) for r in recs)


def test_a_gang_that_lost_a_committed_lease_is_reclaimed_once_no_process_holds_it_without_its_deadline() -> None:
    gang, leases = gang_of(2)
    o = LeaseState.ORPHANED
    left = [_row(i.model_copy(update={"state": o}), 1000.0, n) for n, i in enumerate(leases) if i.id != "r1-weights"]
    assert sorted(reconciler.plan(left, 0.0, lambda r: False, [gang])) == sorted(
        (r.id, LeaseEvent.RECLAIM) for r in left)
    running = [_row(i.info.model_copy(update={"state": A}), None, 0) if i.id == "r0-weights" else i for i in left]
    assert reconciler.plan(running, 0.0, lambda r: r.id == "r0-weights", [gang]) == []  # rank 0 still holds one


def backed_gang(n: int = 2, state: LeaseState = A) -> tuple[Gang, list[LeaseInfo]]:
    """A gang whose every rank holds weights, a KV cache and its KV backup (a host lease named for its rank)."""
    leases = [lease(r, t, state) for r in range(n) for t in (Tag.WEIGHTS, Tag.KV_CACHE)]
    leases += [lease(r, Tag.OTHER, state).model_copy(update={"id": f"r{r}-backup", "name": f"kv_backup.tp{n}-r{r}"})
               for r in range(n)]
    return Gang("g1", n, {r: f"tp-r{r}" for r in range(n)}, {i.id: i.epoch for i in leases}), leases


def test_a_degraded_takeover_gives_every_backup_to_rank_0_and_reclaims_the_rest() -> None:
    gang, leases = backed_gang(3)
    lost = [i.model_copy(update={"state": R}) if i.id.startswith("r2-") and "backup" not in i.id else i
            for i in leases]  # rank 2's GPU failed: its weights and cache gone, its host backup kept
    frozen = [i.model_copy(update={"state": F}) if "backup" in i.id else
              i.model_copy(update={"state": LeaseState.ORPHANED}) if i.state != R else i for i in lost]
    assert degradable(gang, frozen) and [m.lease_id for m in plan_freeze_degraded(gang, lost)] == [
        "r0-backup", "r1-backup", "r2-backup"]
    tokens = {i.id: "tok" for i in frozen if "backup" in i.id}
    succ = {0: "d-r0", 1: "d-r1"}
    moves = plan_degraded(gang, frozen, successors=succ, generation=1, token_of=tokens)
    assert {(m.lease_id, m.event, m.new_owner) for m in moves if m.event is LeaseEvent.TAKEOVER} == {
        (f"r{r}-backup", LeaseEvent.TAKEOVER, "d-r0") for r in range(3)}
    assert sorted(m.lease_id for m in moves if m.event is LeaseEvent.FORCE_RECLAIM) == [
        "r0-kv_cache", "r0-weights", "r1-kv_cache", "r1-weights"]
    nxt = after_degraded(gang, moves, frozen, succ)
    assert nxt is not None and nxt.size == 2 and nxt.generation == 2 and dict(nxt.owners) == succ
    assert nxt.epochs == {f"r{r}-backup": 2 for r in range(3)}
    assert after_degraded(gang, moves, frozen, {0: "alone"}) is None  # a single engine holds no gang


def test_a_degraded_takeover_is_refused_whole_without_every_backup_frozen_at_its_epoch() -> None:
    gang, leases = backed_gang(2, F)
    tokens = {i.id: "tok" for i in leases}
    ok = {"successors": {0: "d"}, "generation": 1, "token_of": tokens}
    no_backup = [i for i in leases if i.id != "r1-backup"]
    assert not degradable(gang, no_backup)
    with pytest.raises(PartialGang, match=r"ranks \[1\] hold no KV backup"):
        plan_degraded(gang, no_backup, **ok)
    with pytest.raises(PartialGang, match="not every rank"):
        plan_freeze_degraded(gang, no_backup)
    with pytest.raises(StaleGang, match="epoch 2"):
        plan_degraded(gang, [i.model_copy(update={"epoch": 2}) if i.id == "r0-backup" else i for i in leases], **ok)
    with pytest.raises(StaleGang, match="generation"):
        plan_degraded(gang, leases, **{**ok, "generation": 2})
    with pytest.raises(PartialGang, match="ranks 0..M-1"):
        plan_degraded(gang, leases, **{**ok, "successors": {0: "a", 2: "c"}})  # a rank missing
    # more ranks than the gang: a degraded group's own gang regrouped into a whole group, the same moves
    wider = plan_degraded(gang, leases, **{**ok, "successors": {0: "d", 1: "b", 2: "c"}})
    assert wider == plan_degraded(gang, leases, **ok)
    with pytest.raises(PartialGang, match="not frozen"):
        plan_degraded(gang, [i.model_copy(update={"state": A}) if i.id == "r1-backup" else i for i in leases], **ok)
    with pytest.raises(StaleGang, match="transfer tokens"):
        plan_degraded(gang, leases, **{**ok, "token_of": {**tokens, "r1-backup": "other"}})


def test_a_broken_gangs_backups_wait_their_deadline_for_a_degraded_group_while_the_rest_goes_at_once() -> None:
    gang, leases = backed_gang(2)
    o = LeaseState.ORPHANED
    left = [_row(i.model_copy(update={"state": o}), 1000.0, n) for n, i in enumerate(leases)
            if not (i.id.startswith("r1-") and "backup" not in i.id)]  # rank 1's GPU memory lost
    planned = sorted(reconciler.plan(left, 0.0, lambda r: False, [gang]))
    assert planned == [("r0-kv_cache", LeaseEvent.RECLAIM), ("r0-weights", LeaseEvent.RECLAIM)]
    backups = [r for r in left if "backup" in r.id]
    assert sorted(reconciler.plan(backups, 1000.0, lambda r: False, [gang])) == [
        ("r0-backup", LeaseEvent.DEADLINE), ("r1-backup", LeaseEvent.DEADLINE)]
    one_backup = [r for r in left if r.id != "r1-backup"]  # not degradable: everything goes at once, as before
    assert sorted(reconciler.plan(one_backup, 0.0, lambda r: False, [gang])) == sorted(
        (r.id, LeaseEvent.RECLAIM) for r in one_backup)
