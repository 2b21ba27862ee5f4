"""A restarted agent still avoids a GPU that failed before it restarted (issue 22, item 1): it reads which GPUs the
gpu_manager holds failed (their `gpus/<node>/<gpu>` records, written from the manager's durable marks) before it
places an engine. A real agent SIGKILLed after a `mark_gpu`, started again with a spec whose first GPU is the
failed one; a real gpu_manager and engine."""

from __future__ import annotations

import asyncio

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import EngineRole, MarkGpu, MarkGpuReply
from libs.common.store import Store
from tests.agent.conftest import TWO_GPUS, AgentProcess, Recorder, pattern_spec
from tests.gpu_manager.harness import ManagerProc


async def gpu_1_failed_then_agent_killed(agent: AgentProcess, bus: Bus, store: Store, settings: CommonSettings) -> None:
    """GPU 1 marked failed through a running agent, then the agent SIGKILLed: it forgets what it saw; the gpu_manager
    does not (its durable mark, its `gpus/<node>/1` record)."""
    agent.start([], gpus=TWO_GPUS)
    await agent.wait_up(store)
    reply = await bus.request(settings.node, MarkGpu(gpu=1, detail="XID 79"), MarkGpuReply, timeout=20)
    assert reply.gpu_manager is not None and not reply.gpu_manager.gpu.healthy
    agent.kill()


async def test_a_restarted_agent_places_no_engine_on_a_gpu_that_failed_before_its_restart(
        two_gpu_manager: ManagerProc, agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store,
        settings: CommonSettings) -> None:
    await gpu_1_failed_then_agent_killed(agent, bus, store, settings)

    spec = pattern_spec(env={"HF_PATTERN_BYTES": str(1 << 20)}).model_copy(update={"gpus": [1, 0]})
    agent.start([spec], gpus=TWO_GPUS)
    ready = await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE)
    assert ready.engine.gpu == 0  # before: GPU 1 (the spec's first), where the manager refuses its lease
    assert not recorder.of("fault.detected")


async def test_an_engine_that_cannot_start_is_said_once_not_at_every_reconcile(
        two_gpu_manager: ManagerProc, agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store,
        settings: CommonSettings) -> None:
    # A spec whose only GPU failed cannot start until the GPU is back: the agent reconciles twice a second and logged
    # each failed try (4 ERROR lines a second for a spec with a standby, for as long as the GPU stays failed).
    await gpu_1_failed_then_agent_killed(agent, bus, store, settings)
    spec = pattern_spec(env={"HF_PATTERN_BYTES": str(1 << 20)}).model_copy(update={"gpus": [1]})
    agent.start([spec], gpus=TWO_GPUS)
    await agent.wait_up(store)
    await asyncio.sleep(3.0)  # six reconciles or more
    lines = [line for line in (agent.log_dir / "agent.log").read_text().splitlines() if "cannot start a" in line]
    assert lines, "the agent never said why the engine does not start"
    assert len([line for line in lines if "active engine" in line]) == 1, lines
    assert not recorder.of("engine.ready")
