"""A host lease (`allocate(host=True)`: a memfd whatever the backend, issue 22 item 4's KV backup) names the GPU it
serves but is not on it: a fault of that GPU reclaims the engine's other leases there and leaves the host lease
live. A real manager on the host backend with two simulated GPUs (the cuda backend's host leases:
tests/engine_batched/test_kv_backup_gpu.py, on a GPU)."""

from __future__ import annotations

from libs.client.memory import MemoryClient
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import LeaseState, ListLeases, ListLeasesReply, SetGpuHealth, SetGpuHealthReply
from tests.gpu_manager.harness import ManagerProc

MIB = 1 << 20


async def test_a_host_lease_outlives_a_fault_of_its_gpu(
        two_gpu_manager: ManagerProc, bus: Bus, settings: CommonSettings) -> None:
    with MemoryClient.connect("eng", socket_path=two_gpu_manager.socket) as client:
        weights = client.allocate(MIB, tag="weights", name="weights", gpu=1)
        kv = client.allocate(MIB, tag="kv_cache", name="kv_cache", gpu=1)
        backup = client.allocate(MIB, tag="other", name="kv_backup", gpu=1, host=True)
        assert backup.info.host and not kv.info.host
        client.register([lease.meta("t-" + lease.info.name, "uint8", (MIB,)) for lease in (weights, kv, backup)])
        client.commit()
        reply = await bus.request(settings.node, SetGpuHealth(gpu=1, healthy=False, detail="XID 79"),
                                  SetGpuHealthReply)
        assert sorted(reply.lost_leases) == sorted([weights.info.id, kv.info.id])
        left = (await bus.request(settings.node, ListLeases(owner="eng"), ListLeasesReply)).leases
        assert [(lease.id, lease.state, lease.host) for lease in left] == [(backup.info.id, LeaseState.ACTIVE, True)]
