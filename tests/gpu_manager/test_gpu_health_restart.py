"""A GPU's failed state outlives its gpu_manager (issue 22, item 1): a real manager on the host backend with two
simulated GPUs, GPU 1 marked failed, then SIGKILLed and started again over the same SQLite file and keeper. It
still refuses leases there (`gpu_unhealthy`) and says so in etcd, until the GPU is marked healthy; a lease found
live on a failed GPU at start (a crash between the durable mark and the reclaim) is reclaimed then."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from libs.client.memory import MemoryClient
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.errors import HoldfastError
from libs.common.events import GpuRecord, ListLeases, ListLeasesReply, SetGpuHealth, SetGpuHealthReply
from libs.common.gpu import simulated_uuid
from libs.common.store import Store
from tests.gpu_manager.harness import ManagerProc
from tests.support import wait_until

MIB = 1 << 20
GRACE_S = 120.0  # far beyond the test's waits: a reclaim seen here is not a deadline's


@pytest.fixture
def two_gpu_manager(manager_factory) -> ManagerProc:  # noqa: ANN001
    return manager_factory(HF_GPUS='["0","1"]', HF_GRACE_S=str(GRACE_S), HF_GPU_PUBLISH_INTERVAL_S="0.1").start()


def refusal(manager: ManagerProc, gpu: int) -> str | None:
    """The error code of an allocate on `gpu` (None: it was granted; the lease is released again)."""
    with MemoryClient.connect(f"probe-{time.monotonic_ns()}", socket_path=manager.socket) as client:
        try:
            lease = client.allocate(MIB, gpu=gpu)
        except HoldfastError as e:  # typed (GpuUnhealthy) or a RemoteError: its code either way
            return e.to_dict()["code"]
        client.release(lease.id)
        return None


async def mark(bus: Bus, settings: CommonSettings, gpu: int, healthy: bool) -> SetGpuHealthReply:
    return await bus.request(settings.node, SetGpuHealth(gpu=gpu, healthy=healthy, detail="" if healthy else "XID 79"),
                             SetGpuHealthReply)


async def record_since(store: Store, settings: CommonSettings, gpu: int, since: float) -> GpuRecord | None:
    """GPU `gpu`'s etcd record once a manager started after `since` wrote it."""
    raw = await store.get(f"gpus/{settings.node}/{gpu}")
    rec = GpuRecord.model_validate_json(raw) if raw else None
    return rec if rec is not None and rec.updated_at > since else None


def restart(manager: ManagerProc) -> float:
    manager.kill()  # SIGKILL: no clean shutdown, the keeper keeps the memory
    since = time.time()
    manager.start()
    return since


async def test_a_failed_gpu_stays_failed_after_its_manager_is_killed_and_restarted(
        two_gpu_manager: ManagerProc, bus: Bus, store: Store, settings: CommonSettings) -> None:
    await mark(bus, settings, 1, healthy=False)
    assert refusal(two_gpu_manager, 1) == "gpu_unhealthy"
    since = restart(two_gpu_manager)
    assert refusal(two_gpu_manager, 1) == "gpu_unhealthy"  # before: granted, a restarted manager started healthy
    assert refusal(two_gpu_manager, 0) is None
    rec = await wait_until(lambda: record_since(store, settings, 1, since), what="GPU 1's record from the new manager")
    assert not rec.healthy and rec.detail == "XID 79" and rec.uuid == simulated_uuid(settings.node, 1)
    rec0 = await wait_until(lambda: record_since(store, settings, 0, since), what="GPU 0's record")
    assert rec0.healthy


async def test_a_gpu_marked_healthy_again_stays_healthy_after_a_restart(
        two_gpu_manager: ManagerProc, bus: Bus, store: Store, settings: CommonSettings) -> None:
    await mark(bus, settings, 1, healthy=False)
    back = await mark(bus, settings, 1, healthy=True)
    assert back.gpu.healthy and back.lost_leases == []
    since = restart(two_gpu_manager)
    assert refusal(two_gpu_manager, 1) is None
    rec = await wait_until(lambda: record_since(store, settings, 1, since), what="GPU 1's record from the new manager")
    assert rec.healthy and rec.detail == ""


async def test_a_lease_still_live_on_a_failed_gpu_at_start_is_reclaimed_then(
        two_gpu_manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    on_1 = engines(two_gpu_manager, "on-1").ask(f"write {MIB} 1 weights 1")["lease"]
    on_0 = engines(two_gpu_manager, "on-0").ask(f"write {MIB} 2 weights 0")["lease"]
    two_gpu_manager.kill()
    # What a manager killed after the mark was durable but before its reclaim committed leaves behind.
    with sqlite3.connect(Path(two_gpu_manager.state_dir) / "gpu_manager.db") as db:
        db.execute("INSERT INTO gpu_health (node, uuid, gpu, detail, at) VALUES (?, ?, ?, ?, ?)",
                   (settings.node, simulated_uuid(settings.node, 1), 1, "XID 79", time.time()))
    two_gpu_manager.start()
    left = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
    assert [i.id for i in left] == [on_0]  # the owner of on_1 still runs: only the GPU's failure took it
    assert on_1 not in [i.id for i in left]
    assert refusal(two_gpu_manager, 1) == "gpu_unhealthy"
