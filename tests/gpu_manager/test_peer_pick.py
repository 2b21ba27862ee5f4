"""Which live lease may serve a restore as its peer (services/gpu_manager/peer.py, pure): the identity rules, the
order among several, and the look again after the copy."""

from __future__ import annotations

from dataclasses import replace

from libs.client.protocol import TensorMeta
from libs.common.events import LeaseInfo, LeaseState, Tag
from services.gpu_manager.artifact import Block, Manifest
from services.gpu_manager.peer import Candidate, Digest, neutral_layout, pick, segments, still_same
from services.gpu_manager.records import LeaseRecord

SIZE = 8192


def tensors(lease: str, shape: int = SIZE) -> list[TensorMeta]:
    return [TensorMeta(lease_id=lease, name="t", offset=0, shape=[shape], dtype="uint8", stride=[1])]


def manifest(root: str, lease: str = "src", shape: int = SIZE) -> Manifest:
    return Manifest(version=1, name="m.w", size=SIZE, tag="weights", lease_name="w", engine_class="m",
                    source_lease=lease, layout_hash="x", tensors=tensors(lease, shape), block_bytes=4096,
                    file_bytes=8192, files=[], hash="blake2b-128", blocks=["a", "b"], root=root, node="node-1",
                    created_at=0.0, write_s=0.0)


def peer(lease: str, *, gpu: int = 0, root: str = "r1", **changes: object) -> Candidate:
    c = Candidate(lease_id=lease, owner=f"eng-{lease}", gpu=gpu, epoch=1, state=LeaseState.ACTIVE, tag=Tag.WEIGHTS,
                  name="m.w", size=SIZE, layout=neutral_layout(tensors(lease)), healthy=True, eligible_memory=True,
                  digest=Digest.of(manifest(root)))
    return replace(c, **changes)  # type: ignore[arg-type]


def test_a_committed_active_hashed_lease_of_the_name_is_a_peer_and_the_destination_gpu_comes_first():
    got, passed = pick([peer("l1", gpu=0), peer("l2", gpu=1), peer("l3", gpu=2)], name="m.w", requester="eng-x",
                       gpu=1, reference=manifest("r1"))
    assert got is not None and got.lease_id == "l2" and passed == []
    got, _ = pick([peer("l3", gpu=2), peer("l1", gpu=0)], name="m.w", requester="eng-x", gpu=5, reference=None)
    assert got is not None and got.lease_id == "l1"  # then the lowest GPU


def test_no_peer_on_an_unhealthy_gpu_frozen_orphaned_uncommitted_unhashed_or_the_requesters_own():
    cands = [peer("sick", healthy=False), peer("frozen", state=LeaseState.FROZEN),
             peer("orphan", state=LeaseState.ORPHANED), peer("half", layout=None), peer("raw", digest=None),
             peer("mine", owner="eng-x"), peer("hostlease", eligible_memory=False), peer("kv", tag=Tag.KV_CACHE),
             peer("other", name="n.w")]
    got, passed = pick(cands, name="m.w", requester="eng-x", gpu=0, reference=None)
    assert got is None
    reasons = " | ".join(passed)
    for why in ("GPU 0 unhealthy", "frozen", "orphaned", "not committed", "never hashed", "the requester's own",
                "a host lease"):
        assert why in reasons, (why, reasons)
    assert "kv" not in reasons and "other" not in reasons  # not copies of this name at all


def test_a_peer_whose_content_or_layout_differs_from_the_node_copy_is_passed():
    got, passed = pick([peer("l1", root="r2")], name="m.w", requester="x", gpu=0, reference=manifest("r1"))
    assert got is None and "is not the node copy's" in passed[0]
    other_shape = manifest("r1", shape=SIZE // 2)
    got, passed = pick([peer("l1")], name="m.w", requester="x", gpu=0, reference=other_shape)
    assert got is None and "is not the node copy's" in passed[0]
    stale = peer("l1", layout=neutral_layout(tensors("l1", SIZE // 2)))  # registered again after its digest
    got, passed = pick([stale], name="m.w", requester="x", gpu=0, reference=None)
    assert got is None and "registered again" in passed[0]


def test_peers_that_disagree_with_no_node_copy_to_tell_serve_none():
    got, passed = pick([peer("l1", root="r1"), peer("l2", root="r2")], name="m.w", requester="x", gpu=0,
                       reference=None)
    assert got is None and "disagree" in passed[-1]
    got, _ = pick([peer("l1", root="r1"), peer("l2", root="r2")], name="m.w", requester="x", gpu=0,
                  reference=manifest("r2"))
    assert got is not None and got.lease_id == "l2"  # the node's copy tells


def record(state: LeaseState = LeaseState.ACTIVE, epoch: int = 1, shape: int = SIZE) -> LeaseRecord:
    info = LeaseInfo(id="l1", node="node-1", gpu=0, size=SIZE, chunk_size=SIZE, tag=Tag.WEIGHTS, name="w",
                     owner="eng-l1", engine_class="m", epoch=epoch, state=state, created_at=0.0, last_seen=0.0,
                     layout_hash="h")
    return LeaseRecord(info=info, owner_uid=0, tensors={"t": tensors("l1", shape)[0]})


def test_the_copy_counts_only_if_the_peer_is_as_it_was_picked():
    held = peer("l1")
    assert still_same(held, record(), healthy=True) is None
    assert "reclaimed" in (still_same(held, None, healthy=True) or "")
    assert "frozen" in (still_same(held, record(LeaseState.FROZEN), healthy=True) or "")
    assert "changed hands" in (still_same(held, record(epoch=2), healthy=True) or "")
    assert "changed hands or layout" in (still_same(held, record(shape=SIZE // 2), healthy=True) or "")
    assert "unhealthy" in (still_same(held, record(), healthy=False) or "")


def test_a_block_is_read_from_the_peer_chunks_it_spans():
    assert segments(Block(1, 4096, 8192, 0, 4096), [6144, 6144]) == [(0, 4096, 0, 2048), (1, 0, 2048, 6144)]


def test_an_engines_report_of_a_peer_load_reaches_the_timeline_line():
    from services.agent.engines import weights_loaded

    raw = {"source": "peer", "load_ms": 12.5,
           "restore": {"bytes": 3.0, "fill_s": 0.01, "peer": {"lease": "lease-x", "gpu": 1, "owner": "eng-a"}}}
    got = weights_loaded(raw)
    assert got is not None and got.describe() == "weights from peer (lease-x on GPU 1) in 12.5 ms"
    host = weights_loaded({"source": "host", "load_ms": 3.0, "restore": {"bytes": 3.0}})
    assert host is not None and host.describe() == "weights from host in 3.0 ms"


def test_a_group_whose_ranks_loaded_from_a_peer_and_the_host_tier_is_at_the_host_tiers_pace():
    from engines.batched.tp_group import group_weights_load

    got = group_weights_load([{"source": "peer", "load_ms": 4.0}, {"source": "host", "load_ms": 9.0}])
    assert got is not None and got["source"] == "host" and got["ranks"] == ["peer", "host"]
    both = group_weights_load([{"source": "peer", "load_ms": 4.0}, {"source": "peer", "load_ms": 3.0}])
    assert both is not None and both["source"] == "peer"
