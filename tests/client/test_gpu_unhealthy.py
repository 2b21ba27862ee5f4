"""The SDK raises the gpu_manager's `gpu_unhealthy` refusal as its own class, `GpuUnhealthy` (issue 22, item 1), so
an engine can tell "this GPU failed: go elsewhere" from any other refusal and still catch it as a `HoldfastError`.
A real manager on the host backend with two simulated GPUs; GPU 1 marked failed through the manager's own
`SetGpuHealth`."""

from __future__ import annotations

import asyncio

import pytest

from libs.client.memory import MemoryClient
from libs.client.protocol import GpuUnhealthy
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.errors import HoldfastError
from libs.common.events import SetGpuHealth, SetGpuHealthReply
from tests.gpu_manager.conftest import two_gpu_manager  # noqa: F401 - fixture
from tests.gpu_manager.harness import ManagerProc

MIB = 1 << 20


def _sleeping_kv(client: MemoryClient) -> str:
    kv = client.allocate(MIB, tag="kv_cache", name="kv", gpu=1)
    client.register([kv.meta("kv", "uint8", (MIB,))])
    client.commit()
    client.sleep([kv.id])
    return kv.id


async def test_a_lease_or_a_wake_on_a_failed_gpu_raises_gpu_unhealthy(
        two_gpu_manager: ManagerProc, bus: Bus, settings: CommonSettings) -> None:  # noqa: F811
    with MemoryClient.connect("sdk-typed", socket_path=two_gpu_manager.socket) as client:
        kv = await asyncio.to_thread(_sleeping_kv, client)
        await bus.request(settings.node, SetGpuHealth(gpu=1, healthy=False, detail="XID 79"), SetGpuHealthReply)

        with pytest.raises(GpuUnhealthy, match="XID 79") as refused:  # before: a generic RemoteError
            await asyncio.to_thread(client.allocate, MIB, gpu=1)
        assert refused.value.code == "gpu_unhealthy" and isinstance(refused.value, HoldfastError)
        with pytest.raises(GpuUnhealthy, match="XID 79"):
            await asyncio.to_thread(client.wake, [kv])
        assert (await asyncio.to_thread(client.allocate, MIB, gpu=0)).info.gpu == 0  # the connection still serves
