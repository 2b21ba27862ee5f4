"""A GPU fault the agent could not tell its gpu_manager (the manager down) survives the agent's death (issue 22,
item 1): the agent keeps the unanswered wish in its state dir (atomically written, 0600) and tells the manager again
when it starts, until the manager answers. A real agent SIGKILLed while its manager is down, both started again; the
manager ends up holding the GPU failed."""

from __future__ import annotations

import stat
import time

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import GpuRecord, MarkGpu, MarkGpuReply
from libs.common.store import Store
from services.agent.gpu_wishes import WISHES_FILE
from tests.agent.conftest import TWO_GPUS, AgentProcess
from tests.gpu_manager.harness import ManagerProc
from tests.support import wait_until

# The restarted agent sends at once, then retries backing off to at most 2 s (services/agent/gpu_reports.py).
APPLIED_WITHIN_S = 10.0


async def test_a_gpu_fault_the_manager_never_heard_of_reaches_it_after_the_agent_was_killed_and_restarted(
        two_gpu_manager: ManagerProc, agent: AgentProcess, bus: Bus, store: Store, settings: CommonSettings) -> None:
    agent.start([], gpus=TWO_GPUS)
    await agent.wait_up(store)
    two_gpu_manager.kill()
    reply = await bus.request(settings.node, MarkGpu(gpu=1, detail="XID 79"), MarkGpuReply, timeout=20)
    assert reply.gpu_manager is None  # nobody answered: only the agent knows
    agent.kill()  # before: the wish died with it

    wishes = settings.state_dir / WISHES_FILE
    assert stat.S_IMODE(wishes.stat().st_mode) == 0o600 and "XID 79" in wishes.read_text()
    agent.start([], gpus=TWO_GPUS)
    await agent.wait_up(store)
    two_gpu_manager.start()  # a fresh manager: GPU 1 healthy in its durable state, told otherwise only by the agent
    back = time.monotonic()
    rec = await wait_until(lambda: _failed_record(store, settings), within_s=APPLIED_WITHIN_S,
                           what="GPU 1's record saying it failed")
    print(f"GPU 1 held failed {time.monotonic() - back:.3f} s after the manager listened again")
    assert rec.detail == "XID 79"
    await wait_until(lambda: not wishes.exists(), what="the answered wish removed from the agent's state dir")


async def _failed_record(store: Store, settings: CommonSettings) -> GpuRecord | None:
    raw = await store.get(f"gpus/{settings.node}/1")
    rec = GpuRecord.model_validate_json(raw) if raw else None
    return rec if rec is not None and not rec.healthy else None
