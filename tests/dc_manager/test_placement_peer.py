"""Placement ranks a node's weight copies closest first (issue 22, item 5): a peer (another engine's live lease of
the same content, copied GPU to GPU) before the host tier, before an artifact, before the original file; the reason
names the source (pure)."""

from __future__ import annotations

from libs.common.cluster_view import GpuSlot
from services.dc_manager.placement import COPY_RANK, Action, node_copies, place

G = 1 << 30
NODES = ("n-peer", "n-host", "n-artifact", "n-file")


def slots() -> list[GpuSlot]:
    # the node with no copy has the most free memory and the fewest engines: only the copies can win over it
    return [GpuSlot("n-peer", 0, True, 80 * G, 70 * G, 3), GpuSlot("n-host", 0, True, 80 * G, 60 * G, 2),
            GpuSlot("n-artifact", 0, True, 80 * G, 50 * G, 1), GpuSlot("n-file", 0, True, 80 * G, 0, 0)]


def records(**kinds: str) -> dict[tuple[str, int], dict]:
    return {(node.replace("_", "-"), 0): {"copies": {"m.weights": kind}} for node, kind in kinds.items()}


def test_the_copies_rank_peer_then_host_then_artifact_then_the_file():
    assert sorted(COPY_RANK, key=COPY_RANK.__getitem__) == ["peer", "host", "artifact"]
    copies = node_copies(records(n_peer="peer", n_host="host", n_artifact="artifact"), "m")
    order = []
    left = set(NODES)
    while left:
        p = place("gone", 0, memory_lost=True, needed_bytes=G, slots=[s for s in slots() if s.node in left],
                  alive=set(NODES), copies=copies)
        assert p.action == Action.COLD_START and p.node is not None
        order.append((p.node, p.reason.rsplit("weights from ", 1)[-1].rstrip(")")))
        left.discard(p.node)
    assert order == [("n-peer", "peer"), ("n-host", "host"), ("n-artifact", "artifact"), ("n-file", "file")]


def test_a_node_holding_a_peer_and_a_host_copy_counts_as_a_peer():
    recs = {("n-host", 0): {"copies": {"m.weights": "host"}},
            ("n-host", 1): {"copies": {"m.weights": "peer", "m.weights.tp2-r1": "artifact"}}}
    assert node_copies(recs, "m") == {"n-host": "peer"}
    assert node_copies(recs, "other") == {}
