"""A GPU fault the agent sees while its gpu_manager is down is applied once the manager is back (issue 22, item 1):
the agent tells the manager (`SetGpuHealth`) until it answers, so the failed GPU's leases are reclaimed within a
retry of the manager's return, not at their grace deadline (here 120 s, far beyond the test). A real agent, a real
gpu_manager SIGKILLed and started again, and a lone engine's lease on the failed GPU."""

from __future__ import annotations

import time

from libs.client.memory import MemoryClient
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import GpuRecord, ListLeases, ListLeasesReply, MarkGpu, MarkGpuReply
from libs.common.store import Store
from tests.agent.conftest import TWO_GPUS, AgentProcess
from tests.gpu_manager.harness import ManagerProc
from tests.support import wait_until

MIB = 1 << 20
# The agent's retries back off to at most 2 s (services/agent/gpu_reports.py): within this of the manager's return.
APPLIED_WITHIN_S = 10.0


async def lease_ids(bus: Bus, settings: CommonSettings) -> set[str]:
    return {i.id for i in (await bus.request(settings.node, ListLeases(), ListLeasesReply, timeout=5)).leases}


async def test_a_gpu_fault_marked_while_the_gpu_manager_is_down_reclaims_its_leases_once_the_manager_is_back(
        two_gpu_manager: ManagerProc, agent: AgentProcess, bus: Bus, store: Store, settings: CommonSettings) -> None:
    agent.start([], gpus=TWO_GPUS)
    await agent.wait_up(store)
    client = MemoryClient.connect("lone", socket_path=two_gpu_manager.socket)
    try:
        doomed = client.allocate(MIB, gpu=1).id
        kept = client.allocate(MIB, gpu=0).id
        two_gpu_manager.kill()

        reply = await bus.request(settings.node, MarkGpu(gpu=1, detail="XID 79"), MarkGpuReply, timeout=20)
        assert reply.gpu_manager is None  # nobody answered: the agent keeps telling it

        two_gpu_manager.start()
        back = time.monotonic()
        await wait_until(lambda: _only(bus, settings, kept), within_s=APPLIED_WITHIN_S,
                         what=f"lease {doomed} on the failed GPU reclaimed")
        print(f"fault applied {time.monotonic() - back:.3f} s after the manager listened again")
        rec = await wait_until(lambda: _failed_record(store, settings), what="GPU 1's record saying it failed")
        assert rec.detail == "XID 79"
    finally:
        client.close()


async def _only(bus: Bus, settings: CommonSettings, lease_id: str) -> bool:
    return await lease_ids(bus, settings) == {lease_id}


async def _failed_record(store: Store, settings: CommonSettings) -> GpuRecord | None:
    raw = await store.get(f"gpus/{settings.node}/1")  # written as the mark is answered, just after the reclaim
    rec = GpuRecord.model_validate_json(raw) if raw else None
    return rec if rec is not None and not rec.healthy else None
