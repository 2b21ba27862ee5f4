"""A lone engine's leases (no gang) on a GPU that fails are reclaimed as the fault is applied, whatever their state,
never at their grace deadline; the other GPU's leases are untouched; a new lease on the failed GPU is refused with
the typed `gpu_unhealthy`, and the same client is still served on the healthy one (issue 22, item 1). A real
manager on the host backend with two simulated GPUs, real engine processes."""

from __future__ import annotations

import pytest

from libs.client.memory import MemoryClient
from libs.client.protocol import GpuUnhealthy
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import LeaseState, ListLeases, ListLeasesReply, SetGpuHealth, SetGpuHealthReply
from tests.gpu_manager.harness import ManagerProc, until

MIB = 1 << 20



async def states(bus: Bus, settings: CommonSettings) -> dict[str, LeaseState]:
    return {i.id: i.state for i in (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases}


async def test_a_lone_engines_leases_on_a_failed_gpu_are_reclaimed_at_once_and_new_ones_refused_typed(
        two_gpu_manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    running = engines(two_gpu_manager, "running")
    live = [running.ask(f"write {MIB} {i} {tag} 1")["lease"] for i, tag in enumerate(("weights", "kv_cache"))]
    dead = engines(two_gpu_manager, "dead")
    orphan = dead.ask(f"write {MIB} 3 weights 1")["lease"]
    spared = engines(two_gpu_manager, "spared").ask(f"write {MIB} 4 weights 0")["lease"]
    dead.kill()
    await until(lambda: _state_is(bus, settings, orphan, LeaseState.ORPHANED))  # waiting out its 120 s grace

    reply = await bus.request(settings.node, SetGpuHealth(gpu=1, healthy=False, detail="XID 79"), SetGpuHealthReply)
    assert sorted(reply.lost_leases) == sorted([*live, orphan])
    assert not reply.gpu.healthy and reply.gpu.leased_bytes == 0 and reply.gpu.leases == 0
    assert await states(bus, settings) == {spared: LeaseState.ACTIVE}  # in the reply's commit, not later

    again = await bus.request(settings.node, SetGpuHealth(gpu=1, healthy=False, detail="XID 79"), SetGpuHealthReply)
    assert again.lost_leases == [] and not again.gpu.healthy  # a repeated mark (an agent's retry) changes nothing

    with MemoryClient.connect("newcomer", socket_path=two_gpu_manager.socket) as client:
        with pytest.raises(GpuUnhealthy) as refused:
            client.allocate(MIB, gpu=1)
        assert refused.value.code == "gpu_unhealthy" and "XID 79" in refused.value.message
        assert client.allocate(MIB, gpu=0).info.gpu == 0  # the same connection, the healthy GPU: served


async def _state_is(bus: Bus, settings: CommonSettings, lease_id: str, state: LeaseState) -> bool:
    return (await states(bus, settings)).get(lease_id) == state
