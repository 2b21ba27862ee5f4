"""A GPU marked failed while the node's state dir is full (ENOSPC: the agent cannot keep the wish on disk): the
GPU's failure still stands and the gpu_manager is still told, as soon as it can take it; the MarkGpu gets its reply,
the agent does not stop, and no broken wish file is left behind. Space back, the manager holds the GPU failed and
the agent's state dir holds no pending wish.

A real agent and gpu_manager whose shared state dir is a small tmpfs (tests/gpu_manager/test_disk_full.py's); mounting
needs root, elsewhere this skips."""

from __future__ import annotations

import json

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import GpuRecord, MarkGpu, MarkGpuReply
from libs.common.store import Store
from services.agent.gpu_wishes import WISHES_FILE
from tests.agent.conftest import TWO_GPUS, AgentProcess
from tests.gpu_manager.harness import ManagerProc
from tests.gpu_manager.test_disk_full import StateDisk, state_disk  # noqa: F401 - the fixture
from tests.support import wait_until


async def test_a_gpu_marked_failed_on_a_full_disk_still_reaches_the_manager(
        state_disk: StateDisk, two_gpu_manager: ManagerProc, agent: AgentProcess,  # noqa: F811
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    agent.start([], gpus=TWO_GPUS)
    await agent.wait_up(store)
    state_disk.fill()
    reply = await bus.request(settings.node, MarkGpu(gpu=1, detail="XID 79"), MarkGpuReply, timeout=20)
    assert reply.gpu == 1 and not reply.healthy
    assert agent.child is not None and agent.child.alive()
    state_disk.free()
    rec = await wait_until(lambda: _failed_record(store, settings), within_s=15, what="GPU 1's record saying it failed")
    assert rec.detail == "XID 79"
    wishes = settings.state_dir / WISHES_FILE
    await wait_until(lambda: not wishes.exists(), what="no pending wish left in the agent's state dir")
    assert not (settings.state_dir / f"{WISHES_FILE}.broken").exists()
    assert agent.child.alive()
    # the wish file, if one was written at all, was whole
    for p in settings.state_dir.glob(f".{WISHES_FILE}*"):
        json.loads(p.read_text())


async def _failed_record(store: Store, settings: CommonSettings) -> GpuRecord | None:
    raw = await store.get(f"gpus/{settings.node}/1")
    rec = GpuRecord.model_validate_json(raw) if raw else None
    return rec if rec is not None and not rec.healthy else None
