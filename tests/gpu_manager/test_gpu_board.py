"""The gpu_manager's GPU board (pure): records, health marks, what may be allocated where."""

from __future__ import annotations

import time

import pytest

from libs.common.errors import NotFound
from libs.common.events import LeaseInfo, LeaseState, Tag
from services.gpu_manager.gpu_board import GpuUnhealthy, host_board, same_record

M = 1 << 20


def lease(i: int, gpu: int, size: int, state: LeaseState = LeaseState.ACTIVE) -> LeaseInfo:
    return LeaseInfo(id=f"l{i}", node="n", gpu=gpu, size=size, chunk_size=size, tag=Tag.WEIGHTS, owner="e", epoch=1,
                     state=state, created_at=0.0, last_seen=0.0)


def test_simulated_gpus_share_the_capacity_and_records_count_live_leases_only() -> None:
    board = host_board("n", ["0", "1"], 100 * M)
    leases = [lease(0, 0, 10 * M), lease(1, 0, 5 * M, LeaseState.FROZEN), lease(2, 1, 7 * M, LeaseState.RECLAIMED)]
    recs = board.records(leases, time.time())
    assert (recs[0].total_bytes, recs[0].leased_bytes, recs[0].leases) == (50 * M, 15 * M, 2)
    assert (recs[1].leased_bytes, recs[1].uuid, recs[1].simulated) == (0, "SIM-n-1", True)
    assert board.room(0, leases) == 35 * M


def test_an_unhealthy_gpu_refuses_allocations_until_marked_healthy_and_an_unknown_gpu_is_not_found() -> None:
    board = host_board("n", ["0", "1"], 100 * M)
    gpu, changed = board.mark("SIM-n-1", False, "XID 79")
    assert gpu.index == 1 and changed
    assert not board.mark(1, False, "XID 79")[1]  # already unhealthy: no change to announce
    with pytest.raises(GpuUnhealthy, match="XID 79") as e:
        board.check_allocatable(1)
    assert e.value.code == "gpu_unhealthy"
    rec = board.records([], 0.0)[1]
    assert not rec.healthy and rec.detail == "XID 79"
    assert board.mark(1, True, "")[1]
    assert board.check_allocatable(1).index == 1
    with pytest.raises(NotFound):
        board.check_allocatable(2)


def test_a_record_is_rewritten_only_when_something_but_its_time_changed() -> None:
    board = host_board("n", ["0"], 100 * M)
    a, b = board.records([], 1.0)[0], board.records([], 2.0)[0]
    assert same_record(a, b) and not same_record(None, b)
    assert not same_record(a, board.records([lease(0, 0, M)], 3.0)[0])


def test_stored_failures_are_restored_by_uuid_and_a_gpu_no_longer_here_is_named() -> None:
    board = host_board("n", ["0", "1"], 100 * M)
    gone = board.restore({"SIM-n-1": "XID 79", "SIM-n-7": "ECC"})
    assert gone == ["SIM-n-7"] and board.unhealthy == {1: "XID 79"}
    with pytest.raises(GpuUnhealthy, match="XID 79"):
        board.check_allocatable(1)
    assert board.check_allocatable(0).index == 0


def test_the_simulated_gpus_nvlinks_from_config_are_in_their_records_both_ways() -> None:
    """`gpu_links` ("0-2"): what NVML's P2P status says of real GPUs (cuda_backend.py `nvlinks`), for placement
    (a group's ranks on GPUs that all reach each other). A malformed pair or an unknown GPU is refused at start."""
    board = host_board("n", ["0", "1", "2"], 90 * M, ["0-2", "2-1"])
    recs = board.records([], time.time())
    assert (recs[0].links, recs[1].links, recs[2].links) == ([2], [2], [0, 1])
    assert host_board("n", ["0", "1"], 90 * M).records([], 0.0)[0].links == []
    for bad, why in (("0-3", "names GPU 3"), ("1-1", "not two GPU indexes"), ("0:1", "not two GPU indexes"),
                     ("a-b", "not two GPU indexes")):
        with pytest.raises(ValueError, match=why):
            host_board("n", ["0", "1", "2"], 90 * M, [bad])


@pytest.mark.gpu
def test_the_cuda_backend_reads_its_gpus_nvlinks_from_nvml() -> None:
    """Every GPU's NVLink peers among the managed ones, both ways (none on a lone GPU; every other on an NVSwitch)."""
    from services.gpu_manager.cuda_backend import CudaBackend

    backend = CudaBackend([])
    links = backend.nvlinks()
    assert set(links) <= set(backend.ordinals)
    for a, peers in links.items():
        assert a not in peers and peers <= set(backend.ordinals)
        assert all(a in links.get(b, frozenset()) for b in peers)
    if len(backend.ordinals) == 1:
        assert links == {}
