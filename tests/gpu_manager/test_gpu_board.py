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
