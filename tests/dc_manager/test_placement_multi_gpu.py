"""Placement on nodes of several GPUs, from the records their gpu_managers publish (`gpus/<node>/<gpu>`: GpuRecord)
and their leases, through the dc_manager's view (pure: `ClusterView.apply`, no etcd)."""

from __future__ import annotations

import json
import time

from libs.common.cluster_view import ClusterView, GpuSlot
from libs.common.events import GpuRecord, LeaseInfo, LeaseState, Tag
from services.dc_manager.placement import Action, Placement, degrade_now, place, place_degraded

M = 1 << 20


def view_of(*records: GpuRecord, leases: tuple[LeaseInfo, ...] = ()) -> ClusterView:
    view = ClusterView()
    for node in {r.node for r in records}:
        view.apply("put", f"nodes/{node}", json.dumps({"node": node, "gpus": []}).encode())
    for rec in records:
        view.apply("put", f"gpus/{rec.node}/{rec.gpu}", rec.model_dump_json().encode())
    for lease in leases:
        view.apply("put", f"allocations/{lease.node}/{lease.id}", lease.model_dump_json().encode())
    return view


def lease(node: str, gpu: int, size: int, n: int = 0) -> LeaseInfo:
    now = time.time()
    return LeaseInfo(id=f"l-{node}-{gpu}-{n}", node=node, gpu=gpu, size=size, chunk_size=size, tag=Tag.WEIGHTS,
                     owner=f"e-{node}-{gpu}", epoch=1, state=LeaseState.ACTIVE, created_at=now, last_seen=now)


def test_a_lost_engine_goes_to_the_healthy_gpu_of_its_node_never_to_the_failed_one_with_more_room() -> None:
    view = view_of(GpuRecord(node="a", gpu=0, uuid="SIM-a-0", total_bytes=100 * M),
                   GpuRecord(node="a", gpu=1, uuid="SIM-a-1", total_bytes=100 * M, healthy=False, detail="XID 79"),
                   leases=(lease("a", 0, 40 * M),))
    p = place("a", 1, memory_lost=True, needed_bytes=50 * M, slots=view.gpu_slots(), alive=set(view.nodes))
    assert (p.action, p.node, p.gpu) == (Action.COLD_START, "a", 0)
    # Live memory on the failed GPU is not reattached in place either.
    p = place("a", 1, memory_lost=False, needed_bytes=0, slots=view.gpu_slots(), alive=set(view.nodes))
    assert p.action is Action.COLD_START and p.gpu == 0 and "unhealthy" in p.reason


def test_free_bytes_decide_between_gpus_and_a_gpu_without_room_is_skipped() -> None:
    view = view_of(GpuRecord(node="a", gpu=0, total_bytes=100 * M), GpuRecord(node="a", gpu=1, total_bytes=100 * M),
                   leases=(lease("a", 0, 30 * M), lease("a", 1, 60 * M)))
    p = place("a", 0, memory_lost=True, needed_bytes=35 * M, slots=view.gpu_slots(), alive={"a"})
    assert (p.node, p.gpu) == ("a", 0)  # 70 MiB free beats 40
    view.apply("put", "allocations/a/l-more", lease("a", 0, 50 * M, 1).model_copy(update={"id": "l-more"})
               .model_dump_json().encode())
    p = place("a", 0, memory_lost=True, needed_bytes=35 * M, slots=view.gpu_slots(), alive={"a"})
    assert (p.node, p.gpu) == ("a", 1)  # 20 MiB left on 0: too little
    p = place("a", 0, memory_lost=True, needed_bytes=45 * M, slots=view.gpu_slots(), alive={"a"})
    assert p.action is Action.NONE


def test_a_gpu_of_unknown_capacity_comes_after_every_gpu_known_to_have_room() -> None:
    # GPU 1 is listed by its node but no gpu_manager reported it: its room is a guess, not the most room.
    slots = [GpuSlot("a", 0, True, 100 * M, 10 * M, 1), GpuSlot("a", 1, True, None, 0, 0)]
    p = place("a", 0, memory_lost=True, needed_bytes=50 * M, slots=slots, alive={"a"})
    assert (p.node, p.gpu) == ("a", 0)
    p = place("a", 0, memory_lost=True, needed_bytes=95 * M, slots=slots, alive={"a"})
    assert (p.node, p.gpu) == ("a", 1)  # none known to have room: the unknown one is still tried


def test_a_tensor_parallel_group_is_placed_on_healthy_gpus_consecutive_first_each_with_room_for_a_rank() -> None:
    recs = [GpuRecord(node="a", gpu=g, total_bytes=100 * M) for g in range(4)]
    view = view_of(*recs, GpuRecord(node="b", gpu=0, total_bytes=100 * M))
    alive = set(view.nodes)
    # node b has one GPU: no room for two ranks there whatever its memory
    p = place("a", 0, memory_lost=True, needed_bytes=50 * M, slots=view.gpu_slots(), alive=alive, tp=2)
    assert (p.action, p.node, p.gpu) == (Action.COLD_START, "a", 0) and "a/0..1" in p.reason
    view.apply("put", "gpus/a/1", GpuRecord(node="a", gpu=1, total_bytes=100 * M, healthy=False).model_dump_json()
               .encode())
    p = place("a", 0, memory_lost=True, needed_bytes=50 * M, slots=view.gpu_slots(), alive=alive, tp=2)
    assert (p.node, p.gpu) == ("a", 2)  # 0..1 and 1..2 hold the failed GPU
    assert p.gpus == (2, 3) and p.rank_gpus == []  # consecutive: the spec's usual layout names none
    view.apply("put", "allocations/a/l-x", lease("a", 3, 60 * M).model_dump_json().encode())
    p = place("a", 0, memory_lost=True, needed_bytes=50 * M, slots=view.gpu_slots(), alive=alive, tp=2)
    # GPU 3 has 40 MiB left: no two consecutive GPUs have room, GPUs 0 and 2 do (rank 1 on GPU 2)
    assert (p.action, p.node, p.gpu, p.rank_gpus) == (Action.COLD_START, "a", 0, [0, 2]) and "a/0,2" in p.reason
    view.apply("put", "allocations/a/l-y", lease("a", 2, 60 * M).model_dump_json().encode())
    p = place("a", 0, memory_lost=True, needed_bytes=50 * M, slots=view.gpu_slots(), alive=alive, tp=2)
    assert p.action is Action.NONE and "no node with 2 healthy gpus" in p.reason
    # live memory is reattached in place only while every GPU of the group is healthy
    p = place("a", 0, memory_lost=False, needed_bytes=0, slots=view.gpu_slots(), alive=alive, tp=2)
    assert p.action is Action.COLD_START and p.reason.startswith("gpu 1 on a is unhealthy")
    p = place("a", 2, memory_lost=False, needed_bytes=0, slots=view.gpu_slots(), alive=alive, tp=2)
    assert (p.action, p.gpu) == (Action.REATTACH, 2)


def test_a_group_goes_on_gpus_that_all_reach_each_other_over_nvlink_first() -> None:
    """A node whose GPUs are joined in pairs across (0-2, 1-3: as GpuRecord.links says, NVML's word): a group of 2
    on 0 and 2 rather than on 0..1, whose all-reduces would cross PCIe; where the links join consecutive GPUs, those;
    where the node says nothing of links, consecutive GPUs as before; a set all linked but without room is not
    taken."""
    def node(links: dict[int, list[int]], sick: int | None = None) -> ClusterView:
        return view_of(*(GpuRecord(node="a", gpu=g, total_bytes=100 * M, healthy=g != sick, links=links.get(g, []))
                         for g in range(4)))

    def where(view: ClusterView, tp: int = 2, need: int = 50 * M) -> tuple[int, ...]:
        p = place("a", 0, memory_lost=True, needed_bytes=need, slots=view.gpu_slots(), alive={"a"}, tp=tp)
        assert p.action is Action.COLD_START, p.reason
        return p.gpus

    across = {0: [2], 2: [0], 1: [3], 3: [1]}
    assert node(across).gpu_slots()[0].links == frozenset({2})
    assert where(node(across)) == (0, 2)
    p = place("a", 0, memory_lost=True, needed_bytes=50 * M, slots=node(across).gpu_slots(), alive={"a"}, tp=2)
    assert p.rank_gpus == [0, 2] and "a/0,2" in p.reason  # the spec names them: not the usual layout
    assert where(node(across, sick=0)) == (1, 3)
    assert where(node({0: [1], 1: [0], 2: [3], 3: [2]})) == (0, 1)
    assert where(node({})) == (0, 1)
    assert where(node({g: [h for h in range(4) if h != g] for g in range(4)}), tp=4) == (0, 1, 2, 3)  # an NVSwitch
    full = node(across)
    full.apply("put", "allocations/a/l-x", lease("a", 2, 60 * M).model_dump_json().encode())
    assert where(full) == (1, 3)  # GPU 2 has 40 MiB left: the other linked pair
    # a degraded group of a TP=4 group that lost GPU 0: 2 ranks on the linked pair 1-3 rather than 1..2
    gpus, _ = place_degraded("a", 4, 100 * M, slots=node(across, sick=0).gpu_slots(), alive={"a"})
    assert gpus == [1, 2, 3]  # 3 ranks fit: no 3 of them all linked, index order
    gpus, _ = place_degraded("a", 3, 100 * M, slots=node(across, sick=0).gpu_slots(), alive={"a"})
    assert gpus == [1, 3]  # 2 ranks: the linked pair


def test_a_degraded_group_is_the_most_ranks_that_fit_on_its_nodes_healthy_gpus() -> None:
    """A group of 4 that lost GPU 3 of its node: 3 ranks on GPUs 0..2, each with room for a third of the group's
    device memory; lost GPU 1 instead: 3 ranks on 0, 2 and 3 (not consecutive: the spec names them); never another
    node's GPUs (the backups are in this node's host memory); fewer ranks when a GPU lacks room; none when not even
    one GPU has room."""
    def node(sick: int, other: bool = False, full: int | None = None) -> ClusterView:
        records = [GpuRecord(node="a", gpu=g, uuid=f"SIM-a-{g}", total_bytes=100 * M, healthy=g != sick)
                   for g in range(4)]
        if other:
            records += [GpuRecord(node="b", gpu=g, uuid=f"SIM-b-{g}", total_bytes=100 * M) for g in range(4)]
        return view_of(*records, leases=(lease("a", full, 60 * M),) if full is not None else ())

    def degraded(view: ClusterView, device: int) -> tuple[list[int], object]:
        gpus, where = place_degraded("a", 4, device, slots=view.gpu_slots(), alive=set(view.nodes))
        assert where.action is (Action.COLD_START if gpus else Action.NONE) and where.gpu == (gpus[0] if gpus else None)
        return gpus, where.node

    assert degraded(node(3), 240 * M) == ([0, 1, 2], "a")  # 80 MiB a rank
    assert degraded(node(1), 240 * M) == ([0, 2, 3], "a")
    assert degraded(node(3, other=True), 240 * M) == ([0, 1, 2], "a")  # node b's healthy GPUs are not looked at
    assert degraded(node(3, full=2), 180 * M) == ([0, 1], "a")  # GPU 2 has 40 MiB free: 2 ranks of 90 MiB
    assert degraded(node(3), 320 * M) == ([], None)  # 107 MiB a rank on 3, 160 on 2, 320 on one: no room


def test_a_specs_degrade_policy_decides_between_fewer_ranks_and_a_whole_group_cold() -> None:
    fits, none = Placement(Action.COLD_START, "a", 4, "room"), Placement(Action.NONE, reason="no room")
    assert [degrade_now(p, fits) for p in ("no_whole_group", "first", "never")] == [False, True, False]
    assert [degrade_now(p, none) for p in ("no_whole_group", "first", "never")] == [True, True, False]
