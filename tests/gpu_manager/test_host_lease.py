"""A host lease (`allocate(host=True)`: a memfd whatever the backend, issue 22 item 4's KV backup) names the GPU it
serves but is not on it: a fault of that GPU reclaims the engine's other leases there and leaves the host lease
live. A real manager on the host backend with two simulated GPUs (the cuda backend's host leases:
tests/engine_batched/test_kv_backup_gpu.py, on a GPU)."""

from __future__ import annotations

import pytest

from libs.client.memory import MemoryClient
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.errors import PermissionDenied, RemoteError
from libs.common.events import (
    Freeze,
    FreezeReply,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    SetGpuHealth,
    SetGpuHealthReply,
)
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


async def test_a_kv_backup_alone_is_frozen_and_handed_only_to_a_successor_that_loads_its_weights(
        two_gpu_manager: ManagerProc, bus: Bus, settings: CommonSettings) -> None:
    """The engine's weights and cache lost with GPU 1, its backup live: `Freeze(backups_only)` freezes the backup
    alone (the reply names the unhealthy GPU, for placement); a plain takeover of it is refused as a set without
    weights, one with `cold_weights` gets the backup, its content as written."""
    with MemoryClient.connect("eng", socket_path=two_gpu_manager.socket) as client:
        weights = client.allocate(MIB, tag="weights", name="weights", gpu=1)
        backup = client.allocate(MIB, tag="other", name="kv_backup", gpu=1, host=True)
        backup.torch("uint8", (MIB,))[:] = 7
        client.register([lease.meta("t-" + lease.info.name, "uint8", (MIB,)) for lease in (weights, backup)])
        client.commit()
        await bus.request(settings.node, SetGpuHealth(gpu=1, healthy=False, detail="XID 79"), SetGpuHealthReply)
        with pytest.raises(RemoteError) as none:
            await bus.request(settings.node, Freeze(owner="nobody", backups_only=True), FreezeReply)
        assert none.value.remote_code == "not_found"
        frozen = await bus.request(settings.node, Freeze(owner="eng", incident_id="inc-gpu", backups_only=True),
                                   FreezeReply)
        assert frozen.lease_ids == [backup.info.id] and list(frozen.unhealthy_gpus) == [1]
        again = await bus.request(settings.node, Freeze(owner="eng", backups_only=True), FreezeReply)
        assert again.transfer_token == frozen.transfer_token  # a redelivered freeze: the same token
        with MemoryClient.connect("eng-next", socket_path=two_gpu_manager.socket) as successor:
            with pytest.raises(RemoteError) as incomplete:  # a successor that would run from it needs the weights
                successor.takeover("eng", frozen.transfer_token)
            assert incomplete.value.remote_code == "incomplete_leases"
            with pytest.raises(PermissionDenied):
                successor.takeover("eng", "w" * 24, cold_weights=True)
            att = successor.takeover("eng", frozen.transfer_token, cold_weights=True)
            assert [lease.id for lease in att.leases] == [backup.info.id]
            (meta,) = att.leases[0].tensor_metas
            assert bool((att.leases[0].view(meta, "torch") == 7).all())
            left = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
            assert [(i.id, i.owner, i.state) for i in left] == [(backup.info.id, "eng-next", LeaseState.ACTIVE)]
