"""A cold start sent to this node (the dc_manager's fallback `Spawn`, maybe for another node's engine, in that node's
spec) changes this node's spec only once its engine is admitted and started, and then keeps this node's own counts
(probe of 2026-12-07, multi-node finding 3: a refused cold start carrying another node's spec, `standbys: 0`, was
stored first, and this node's warm standby was stopped as "more than its spec wants"; one naming a GPU the node
lacks was stored too, and every later start of the spec failed on it, across restarts)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from libs.common.bus import Bus
from libs.common.errors import RemoteError
from libs.common.events import EngineRole, EngineSpec, ListEngines, ListEnginesReply, Spawn, SpawnReply
from libs.common.store import Store
from services.agent.supervision import spec_after_cold_start, spec_key
from tests.agent.conftest import AgentProcess, Recorder, pattern_spec
from tests.support import wait_until

OWN = pattern_spec(standbys=1)  # this node's: one active, one warm standby
KEY = spec_key(OWN)
OTHERS = pattern_spec(standbys=0)  # the same key as another node runs it: no standby
SPEC_KEY = f"agents/node-1/specs/{KEY}"


async def stored(store: Store) -> EngineSpec | None:
    raw = await store.get(SPEC_KEY)
    return EngineSpec.model_validate_json(raw) if raw else None


async def listed(bus: Bus) -> dict[str, tuple[EngineRole, str]]:
    reply = await bus.request("node-1", ListEngines(), ListEnginesReply, timeout=10)
    return {e.engine_id: (e.role, e.state) for e in reply.engines}


async def spawn(bus: Bus, spec: EngineSpec, incident: str) -> SpawnReply:
    return await bus.request("node-1", Spawn(spec=spec, engine_id=f"cs-{incident}", incident_id=incident), SpawnReply,
                             timeout=20)


async def test_a_cold_start_keeps_this_nodes_spec_refused_failed_or_admitted(agent: AgentProcess, recorder: Recorder,
                                                                            bus: Bus, store: Store) -> None:
    agent.start([OWN])
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE)).engine
    standby = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.STANDBY)).engine
    assert await wait_until(lambda: stored(store)) == OWN

    # refused: this node runs its spec's one active already
    with pytest.raises(RemoteError) as refused:
        await spawn(bus, OTHERS, "inc-a")
    assert refused.value.remote_code == "conflict"
    # its own active dies (its slot free for a cold start); then one naming a GPU this node lacks fails to start
    assert active.pid is not None
    os.kill(active.pid, signal.SIGKILL)
    await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id)
    with pytest.raises(RemoteError) as no_gpu:
        await spawn(bus, OTHERS.model_copy(update={"gpus": [1]}), "inc-b")
    assert no_gpu.value.remote_code == "not_found" and "no GPU" in no_gpu.value.message
    await asyncio.sleep(1.0)  # five reconcile passes (0.2 s)
    assert await stored(store) == OWN
    assert (await listed(bus)).get(standby.engine_id) == (EngineRole.STANDBY, "standby")

    # admitted into the free slot: the engine is started, and the spec stays this node's (its standby kept)
    cold = (await spawn(bus, OTHERS, "inc-c")).engine
    await recorder.wait("engine.ready", lambda e: e.engine.engine_id == cold.engine_id)
    await asyncio.sleep(1.0)
    assert await stored(store) == OWN
    now = await listed(bus)
    assert now.get(standby.engine_id) == (EngineRole.STANDBY, "standby")
    assert not recorder.of("engine.stopped")
    assert "more than its spec wants" not in (agent.log_dir / "agent.log").read_text()


async def test_a_cold_start_on_a_node_without_the_spec_stores_it_for_the_one_replica_started_there(
        agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store) -> None:
    agent.start([])
    await agent.wait_up(store)
    sent = pattern_spec(replicas=2, standbys=1)  # the lost node's spec: two replicas there, one of them lost
    cold = (await spawn(bus, sent, "inc-d")).engine
    await recorder.wait("engine.ready", lambda e: e.engine.engine_id == cold.engine_id)
    await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.STANDBY)  # its standby, here too
    await asyncio.sleep(1.0)
    assert await stored(store) == sent.model_copy(update={"replicas": 1})
    actives = [e for e, (role, _) in (await listed(bus)).items() if role is EngineRole.ACTIVE]
    assert actives == [cold.engine_id]  # not a second active for the other node's count


async def test_a_node_whose_spec_wants_none_takes_a_lost_replica_back(
        agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store) -> None:
    """Its replica moved away (the lost-node pass stopped it when its node came back: a stop is one fewer), then the
    node it moved to died: this node must take the cold start, as an empty node would, not refuse it for a count of
    0 (the model went unserved, probe of 2026-12-07)."""
    none = pattern_spec(replicas=0, standbys=0)
    agent.start([none])
    await agent.wait_up(store)
    assert await wait_until(lambda: stored(store)) == none
    cold = (await spawn(bus, none.model_copy(update={"replicas": 1}), "inc-e")).engine
    await recorder.wait("engine.ready", lambda e: e.engine.engine_id == cold.engine_id)
    await asyncio.sleep(1.0)
    assert await stored(store) == none.model_copy(update={"replicas": 1})  # it runs that replica now
    actives = [e for e, (role, _) in (await listed(bus)).items() if role is EngineRole.ACTIVE]
    assert actives == [cold.engine_id]


def test_the_spec_after_a_cold_start_is_this_nodes_own_with_the_gpu_it_runs_on():
    own = pattern_spec(replicas=2, standbys=1).model_copy(update={"gpus": [0, 2], "spares": 1})
    sent = pattern_spec(replicas=1, standbys=0).model_copy(update={"gpus": [1]})
    after = spec_after_cold_start(own, sent)
    assert after == own.model_copy(update={"gpus": [0, 2, 1]})  # counts, spares and GPU order kept
    assert spec_after_cold_start(own, sent.model_copy(update={"gpus": [2]})) == own  # a GPU it names: unchanged
    assert spec_after_cold_start(None, sent.model_copy(update={"replicas": 3})) == sent  # none here: one replica
