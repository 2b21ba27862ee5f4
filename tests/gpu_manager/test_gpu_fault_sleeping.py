"""A sleeping lease on a GPU marked failed holds no memory, so the mark leaves it asleep; waking it there must be
refused with the typed `gpu_unhealthy` (the GPU's memory may be lost at any moment), the lease left asleep, and
the same wake served once the GPU is marked healthy again (issue 22, item 1). A real manager on the host backend
with two simulated GPUs."""

from __future__ import annotations

import asyncio

import pytest

from libs.client.memory import MemoryClient
from libs.client.protocol import GpuUnhealthy
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import LeaseState, ListLeases, ListLeasesReply, SetGpuHealth, SetGpuHealthReply
from tests.gpu_manager.harness import ManagerProc

MIB = 1 << 20



def _sleeper(manager: ManagerProc) -> tuple[MemoryClient, str]:
    c = MemoryClient.connect("sleeper", socket_path=manager.socket, engine_class="sleepy")
    kv = c.allocate(2 * MIB, tag="kv_cache", name="kv", gpu=1)
    c.register([kv.meta("kv", "uint8", (2 * MIB,))])
    c.commit()
    c.sleep([kv.id])
    return c, kv.id


async def _state(bus: Bus, settings: CommonSettings, lease_id: str) -> LeaseState | None:
    leases = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
    return next((i.state for i in leases if i.id == lease_id), None)


async def test_a_sleeping_lease_is_not_woken_on_a_failed_gpu(two_gpu_manager: ManagerProc, bus: Bus,
                                                               settings: CommonSettings) -> None:
    client, kv = await asyncio.to_thread(_sleeper, two_gpu_manager)
    try:
        await bus.request(settings.node, SetGpuHealth(gpu=1, healthy=False, detail="XID 79"), SetGpuHealthReply)
        assert await _state(bus, settings, kv) == LeaseState.SLEEPING  # no memory to lose: left asleep
        with pytest.raises(GpuUnhealthy) as refused:
            await asyncio.to_thread(client.wake, [kv])
        assert refused.value.code == "gpu_unhealthy" and "XID 79" in refused.value.message
        assert await _state(bus, settings, kv) == LeaseState.SLEEPING  # refused: nothing changed

        await bus.request(settings.node, SetGpuHealth(gpu=1, healthy=True), SetGpuHealthReply)
        await asyncio.to_thread(client.wake, [kv])
        assert await _state(bus, settings, kv) == LeaseState.ACTIVE
    finally:
        client.close()
