"""An engine killed while it allocates its leases at start-up (issue 18, part 1): what it never committed is
reclaimed, never frozen and offered to a successor (manager.py invariant 5)."""

from __future__ import annotations

import json

import pytest

from libs.client.protocol import TensorMeta
from libs.common.errors import RemoteError
from libs.common.events import Freeze, FreezeReply, LeaseInfo, LeaseState, ListLeases, ListLeasesReply, Tag
from services.gpu_manager.manager import IncompleteLeaseSet, check_complete, split_for_freeze
from services.gpu_manager.records import LeaseRecord
from tests.gpu_manager.harness import until

N = 2 * 1024 * 1024 + 100
NODE = "node-1"


async def leases_of(bus, owner: str) -> list[LeaseInfo]:  # noqa: ANN001
    return (await bus.request(NODE, ListLeases(owner=owner), ListLeasesReply)).leases


async def test_an_engine_killed_before_committing_its_weights_is_refused_a_freeze_and_its_lease_reclaimed(
        manager, engines, bus):
    half = engines(manager, "eng-half")
    assert half.ask(f"call allocate {json.dumps({'size': N, 'name': 'weights'})}")["code"] == "ok"
    [lease] = await leases_of(bus, "eng-half")
    assert lease.tag == Tag.WEIGHTS and lease.layout_hash is None
    half.kill()

    with pytest.raises(RemoteError) as refused:
        await bus.request(NODE, Freeze(owner="eng-half", incident_id="inc-half"), FreezeReply)
    # not_found: the control plane's fallback (a cold start from the weights file) follows
    assert refused.value.remote_code == "not_found" and "committed no weights" in refused.value.message
    assert await leases_of(bus, "eng-half") == []  # reclaimed at once, not left frozen for a successor

    standby = engines(manager, "eng-standby")
    assert standby.ask("takeover eng-half anything")["code"] == "not_found"


async def test_a_freeze_offers_only_the_committed_leases_and_reclaims_one_allocated_after_the_commit(
        manager, engines, bus):
    old = engines(manager, "eng-loading")
    wrote = old.ask(f"write {N} 21")  # weights: allocated, registered, committed
    assert old.ask(f"call allocate {json.dumps({'size': N, 'tag': 'kv_cache', 'name': 'kv'})}")["code"] == "ok"
    kv = next(i for i in await leases_of(bus, "eng-loading") if i.tag == Tag.KV_CACHE)
    old.kill()

    frozen = await bus.request(NODE, Freeze(owner="eng-loading", incident_id="inc-loading"), FreezeReply)
    assert frozen.lease_ids == [wrote["lease"]]
    assert [i.id for i in await leases_of(bus, "eng-loading")] == [wrote["lease"]]
    assert kv.id not in frozen.lease_ids

    successor = engines(manager, "eng-next")
    got = successor.ask(f"takeover eng-loading {frozen.transfer_token}")
    assert got["leases"] == {wrote["lease"]: 2} and got["data"] == wrote["expected"]

    async def only_the_weights_live() -> bool:
        listed = await bus.request(NODE, ListLeases(), ListLeasesReply)
        return [(i.id, i.state) for i in listed.leases] == [(wrote["lease"], LeaseState.ACTIVE)]

    await until(only_the_weights_live)


def _rec(lease_id: str, tag: Tag, *, committed: bool, tensors: int = 1) -> LeaseRecord:
    info = LeaseInfo(id=lease_id, node=NODE, gpu=0, size=4096, chunk_size=4096, tag=tag, name=lease_id, owner="eng",
                     engine_class="reference", epoch=1, state=LeaseState.FROZEN, created_at=0.0, last_seen=0.0,
                     layout_hash="h" if committed else None)
    metas = {f"t{i}": TensorMeta(name=f"t{i}", lease_id=lease_id, offset=0, shape=[1], dtype="uint8")
             for i in range(tensors)}
    return LeaseRecord(info=info, owner_uid=0, tensors=metas)


def test_the_freeze_split_keeps_a_committed_weights_set_and_drops_every_uncommitted_lease():
    weights, kv = _rec("w", Tag.WEIGHTS, committed=True), _rec("kv", Tag.KV_CACHE, committed=False)
    assert split_for_freeze([weights, kv]) == ([weights], [kv])
    # registered tensors but no commit: a partial set, nothing to freeze
    partial = _rec("w2", Tag.WEIGHTS, committed=False, tensors=3)
    cache = _rec("kv2", Tag.KV_CACHE, committed=True)
    assert split_for_freeze([partial, cache]) == ([], [partial])


def test_a_frozen_partial_set_is_refused_to_a_successor_with_a_typed_error():
    with pytest.raises(IncompleteLeaseSet, match="never committed"):
        check_complete("eng", [_rec("w", Tag.WEIGHTS, committed=True), _rec("w2", Tag.WEIGHTS, committed=False)])
    with pytest.raises(IncompleteLeaseSet, match="no weights"):
        check_complete("eng", [_rec("kv", Tag.KV_CACHE, committed=True)])
    check_complete("eng", [_rec("w", Tag.WEIGHTS, committed=True), _rec("kv", Tag.KV_CACHE, committed=True)])


def _backup(lease_id: str, *, committed: bool = True, host: bool = True) -> LeaseRecord:
    rec = _rec(lease_id, Tag.OTHER, committed=committed)
    rec.info = rec.info.model_copy(update={"name": "kv_backup", "host": host})
    return rec


def test_a_set_of_kv_backups_alone_is_frozen_and_complete_only_for_a_successor_that_loads_its_weights():
    weights, kv, backup = _rec("w", Tag.WEIGHTS, committed=True), _rec("kv", Tag.KV_CACHE, committed=True), _backup("b")
    half = _backup("b2", committed=False)
    assert split_for_freeze([weights, kv, backup, half], backups_only=True) == ([backup], [])  # nothing else touched
    assert split_for_freeze([weights, _backup("dev", host=False)], backups_only=True) == ([], [])  # not host memory
    check_complete("eng", [backup], cold_weights=True)
    with pytest.raises(IncompleteLeaseSet, match="no weights"):
        check_complete("eng", [backup])
    with pytest.raises(IncompleteLeaseSet, match="no weights"):  # a cache beside it: not a backup-only set
        check_complete("eng", [backup, kv], cold_weights=True)
    with pytest.raises(IncompleteLeaseSet, match="never committed"):
        check_complete("eng", [half], cold_weights=True)
