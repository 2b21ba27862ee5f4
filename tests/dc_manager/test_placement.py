"""Placement (pure)."""

from __future__ import annotations

from libs.common.cluster_view import GpuSlot
from services.dc_manager.placement import Action, place

G = 1 << 30


def slots() -> list[GpuSlot]:
    return [GpuSlot("a", 0, True, 80 * G, 40 * G, 1), GpuSlot("a", 1, True, 80 * G, 70 * G, 1),
            GpuSlot("b", 0, True, 80 * G, 0, 0), GpuSlot("b", 1, False, 80 * G, 0, 0)]


def test_live_memory_on_a_healthy_gpu_is_reattached_in_place() -> None:
    p = place("a", 1, memory_lost=False, needed_bytes=40 * G, slots=slots(), alive={"a", "b"})
    assert (p.action, p.node, p.gpu) == (Action.REATTACH, "a", 1)


def test_lost_memory_is_cold_started_on_the_same_node_first_when_it_has_room() -> None:
    p = place("a", 1, memory_lost=True, needed_bytes=30 * G, slots=slots(), alive={"a", "b"})
    assert (p.action, p.node, p.gpu) == (Action.COLD_START, "a", 0)


def test_an_unhealthy_gpu_or_a_gone_node_moves_the_engine_to_the_gpu_with_most_room() -> None:
    p = place("b", 1, memory_lost=False, needed_bytes=50 * G, slots=slots(), alive={"a", "b"})
    assert (p.action, p.node, p.gpu) == (Action.COLD_START, "b", 0)
    p = place("c", 0, memory_lost=False, needed_bytes=50 * G, slots=slots(), alive={"a", "b"})
    assert (p.action, p.node, p.gpu) == (Action.COLD_START, "b", 0)


def test_no_gpu_with_room_means_no_placement() -> None:
    p = place("a", 0, memory_lost=True, needed_bytes=90 * G, slots=slots(), alive={"a", "b"})
    assert p.action is Action.NONE and "no healthy gpu" in p.reason


def test_a_manager_places_only_on_its_own_nodes() -> None:
    p = place("a", 0, memory_lost=True, needed_bytes=10 * G, slots=slots(), alive={"a", "b"}, allowed=frozenset({"b"}))
    assert (p.node, p.gpu) == ("b", 0)


def test_a_cold_start_prefers_a_node_holding_a_copy_of_the_weights_host_tier_first() -> None:
    near = dict(memory_lost=True, needed_bytes=10 * G, slots=slots(), alive={"a", "b"})
    assert place("a", 1, **near).node == "a"  # no copies: the same node first
    p = place("a", 1, **near, copies={"b": "artifact"})
    assert (p.node, p.gpu) == ("b", 0) and "weights from artifact" in p.reason
    assert place("a", 1, **near, copies={"a": "artifact", "b": "host"}).node == "b"  # the host tier beats a disk
    assert place("a", 1, **near, copies={"a": "host", "b": "host"}).node == "a"  # equal copies: the same node
    full = dict(near, needed_bytes=50 * G)
    assert place("a", 1, **full, copies={"a": "host"}).node == "b"  # a copy on a node without room does not count


def test_node_copies_keeps_each_nodes_closest_copy_of_the_class() -> None:
    from services.dc_manager.placement import node_copies

    records = {("a", 0): {"copies": {"batched.weights": "artifact", "reference.w": "host"}},
               ("a", 1): {"copies": {"batched.weights": "artifact"}},
               ("b", 0): {"copies": {"batched.weights": "host", "batchedx.w": "artifact"}},
               ("c", 0): {}}
    assert node_copies(records, "batched") == {"a": "artifact", "b": "host"}
    assert node_copies(records, "reference") == {"a": "host"}
