"""A gang whose ranks back their KV caches up to host (gang.py invariant 9, pure): a rank's cache gone while it holds
its backup and its weights leaves the gang whole (frozen, taken over, not reclaimed early as broken); a cache gone
without its backup, or more leases gone than caches backed up, is a loss as before."""

from __future__ import annotations

import pytest

from libs.common.events import LeaseInfo, LeaseState, Tag
from services.gpu_manager import reconciler
from services.gpu_manager.fsm import LeaseEvent
from services.gpu_manager.gang import Gang, PartialGang, after_takeover, broken, plan
from services.gpu_manager.records import LeaseRecord

A, ORPH, F, R = LeaseState.ACTIVE, LeaseState.ORPHANED, LeaseState.FROZEN, LeaseState.RECLAIMED
NAMES = {Tag.WEIGHTS: "weights.tp2-r{r}", Tag.KV_CACHE: "kv_cache", Tag.OTHER: "kv_backup.tp2-r{r}"}


def lease(rank: int, tag: Tag, state: LeaseState = A) -> LeaseInfo:
    return LeaseInfo(id=f"r{rank}-{tag.value}", node="n", gpu=rank, size=1, chunk_size=1, tag=tag,
                     name=NAMES[tag].format(r=rank), owner=f"tp-r{rank}", epoch=1, state=state, created_at=0.0,
                     last_seen=0.0, host=tag is Tag.OTHER)


def backed_gang(state: LeaseState = A) -> tuple[Gang, list[LeaseInfo]]:
    leases = [lease(r, t, state) for r in range(2) for t in (Tag.WEIGHTS, Tag.KV_CACHE, Tag.OTHER)]
    return Gang("g1", 2, {0: "tp-r0", 1: "tp-r1"}, {i.id: i.epoch for i in leases}), leases


def without(leases: list[LeaseInfo], *ids: str) -> list[LeaseInfo]:
    return [i.model_copy(update={"state": R}) if i.id in ids else i for i in leases]


def test_every_ranks_cache_lost_beside_its_backup_leaves_the_gang_whole_and_takeable() -> None:
    gang, leases = backed_gang(F)
    lost = without(leases, "r0-kv_cache", "r1-kv_cache")
    assert not broken(gang, lost)
    moves = plan(gang, lost, LeaseEvent.TAKEOVER, successors={0: "s-r0", 1: "s-r1"}, generation=1,
                 token_of={i.id: "tok" for i in leases})
    assert sorted(m.lease_id for m in moves) == ["r0-other", "r0-weights", "r1-other", "r1-weights"]
    after = after_takeover(gang, moves, lost)
    assert sorted(after.epochs) == ["r0-other", "r0-weights", "r1-other", "r1-weights"] and after.generation == 2


def test_one_ranks_cache_lost_beside_its_backup_leaves_the_gang_whole() -> None:
    gang, leases = backed_gang()
    lost = without(leases, "r1-kv_cache")
    assert not broken(gang, lost)
    assert len(plan(gang, lost, LeaseEvent.FREEZE)) == 5


@pytest.mark.parametrize("gone", [("r1-kv_cache", "r1-other"), ("r1-weights",), ("r1-other",),
                                  ("r1-kv_cache", "r0-weights")])
def test_a_cache_lost_without_its_backup_or_any_other_lease_lost_is_partial(gone: tuple[str, ...]) -> None:
    gang, leases = backed_gang()
    lost = without(leases, *gone)
    assert broken(gang, lost)
    with pytest.raises(PartialGang):
        plan(gang, lost, LeaseEvent.FREEZE)


def test_the_reconciler_keeps_a_gang_whose_caches_are_backed_up_until_its_deadline() -> None:
    gang, leases = backed_gang(ORPH)
    left = [LeaseRecord(info=i.model_copy(update={"deadline": 1000.0}), owner_uid=0, owner_pid=n + 10)
            for n, i in enumerate(leases) if i.tag is not Tag.KV_CACHE]
    assert reconciler.plan(left, 0.0, lambda r: False, [gang]) == []  # waits for its successor group
    assert sorted(reconciler.plan(left, 1001.0, lambda r: False, [gang])) == sorted(
        (r.id, LeaseEvent.DEADLINE) for r in left)
