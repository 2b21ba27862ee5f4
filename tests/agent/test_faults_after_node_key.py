"""A restarted agent publishes the faults it finds as it re-adopts its engines only once its node key is back in
etcd (probe of 2026-12-07, multi-node finding 4): an agent SIGKILLed, its active engine dead while it was away and its
node key expired meanwhile, came back and published that death before `nodes/<node>`; the dc_manager, seeing the
fault of a node it had no key for, took the node for gone and skipped the reattach in place (the live memory, the
waiting standby) for a cold start elsewhere."""

from __future__ import annotations

import os
import signal

from libs.common.bus import Bus
from libs.common.events import Envelope, FaultDetected, NodeInfo
from libs.common.store import Store
from tests.agent.conftest import AgentProcess, Recorder, alive, engine_records, pattern_spec
from tests.support import wait_until

NODE_KEY = "nodes/node-1"


async def test_a_death_found_at_readoption_is_published_once_the_node_key_is_back(
        agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store) -> None:
    spec = pattern_spec()
    agent.start([spec])
    first = await agent.wait_up(store)
    active = (await recorder.wait("engine.ready")).engine
    assert active.pid is not None
    await wait_until(lambda: _recorded_ready(store, active.engine_id), what="the engine's record")
    agent.kill(signal.SIGKILL)
    os.kill(active.pid, signal.SIGKILL)  # dies while nobody watches it
    await wait_until(lambda: not alive(active.pid), what="the engine's death")
    await wait_until(lambda: _absent(store), within_s=15, what="the node key to expire")

    # What etcd holds for the node at the moment the fault reaches a subscriber (the dc_manager's view follows etcd).
    node_at_fault: list[NodeInfo | None] = []

    async def on_fault(env: Envelope) -> None:
        if isinstance(env.data, FaultDetected) and env.data.engine_id == active.engine_id:
            raw = await store.get(NODE_KEY)
            node_at_fault.append(NodeInfo.model_validate_json(raw) if raw else None)

    await bus.subscribe("fault.>", on_fault)
    agent.start([spec])
    fault = await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id, within_s=20)
    assert "while the agent was away" in fault.detail
    await wait_until(lambda: node_at_fault, what="the fault at the test's subscriber")
    seen = node_at_fault[0]
    assert seen is not None, "the fault went out while nodes/node-1 was absent"
    assert seen.agent_pid == agent.child.pid != first.agent_pid  # the restarted agent's key, not the old one's
    # one fault for that generation, and its record says failed (written after the fault, as any fault's)
    assert len(recorder.of("fault.detected", lambda f: f.engine_id == active.engine_id)) == 1
    assert len(node_at_fault) == 1
    await wait_until(lambda: _failed_or_replaced(store, active.engine_id), what="the failed engine's record")


async def _absent(store: Store) -> bool:
    return await store.get(NODE_KEY) is None


async def _recorded_ready(store: Store, engine_id: str) -> bool:
    rec = (await engine_records(store)).get(engine_id)
    return rec is not None and rec.state == "ready"


async def _failed_or_replaced(store: Store, engine_id: str) -> bool:
    rec = (await engine_records(store)).get(engine_id)
    return rec is None or rec.state == "failed"
