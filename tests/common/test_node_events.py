"""Node-scoped events on the secured stack (issue 20): a node's identity cannot fault another node's engine.

Real nats-server with the per-role permissions, real controller and dc_manager processes, the node side
simulated (devstack/simcluster.py). The forger holds node-2's agent credentials and uses the agent's own path
(`Bus.emit`) against an engine of node n0000."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from devstack.simcluster import SimulatedCluster
from libs.common.bus import Bus, engines_on_their_nodes
from libs.common.config import CommonSettings
from libs.common.errors import WrongNode
from libs.common.events import (
    EngineInfo,
    EngineReady,
    EngineReattached,
    EngineRole,
    EngineStopped,
    Envelope,
    FaultDetected,
    FaultKind,
    LeaseChanged,
    LeaseInfo,
    LeaseState,
    MemoryFrozen,
    Tag,
    event_subject,
)
from libs.common.security.policy import nats_permissions
from libs.common.store import Store
from services.controller.incident import IncidentRecord, incident_id_for
from tests.controller.helpers import control_plane, service_env, wait_for


@asynccontextmanager
async def _agent_of(settings: CommonSettings, node: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(settings.model_copy(update={"node": node}), f"agent:{node}")
    try:
        yield bus
    finally:
        await bus.close()


def _forged(victim: str, node: str) -> FaultDetected:
    return FaultDetected(engine_id=victim, model="m", engine_class="sim", kind=FaultKind.KILLED, signal=9, node=node)


async def _incident(store: Store, engine_id: str) -> IncidentRecord | None:
    return await store.get_model(f"incidents/{incident_id_for(engine_id, 0)}", IncidentRecord)


async def _ended(store: Store, engine_id: str) -> IncidentRecord | None:
    rec = await _incident(store, engine_id)
    return rec if rec is not None and rec.terminal else None


async def test_another_nodes_agent_cannot_fault_an_engine_it_does_not_run(
        bus: Bus, store: Store, settings: CommonSettings, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=2)
    await sim.populate()
    await sim.serve()
    victim, witness = sim.engine_id("n0000", 0), sim.engine_id("n0000", 1)
    async with control_plane(bus, store, service_env(settings_env), tmp_path), _agent_of(settings, "node-2") as forger:
        # A fault for the victim's node: the server refuses node-2's identity that subject (no stream ack).
        with pytest.raises(Exception):  # noqa: B017 - nats-py's timeout or no-responders error
            await forger.emit(_forged(victim, node="n0000"))
        # On node-2's own subject, naming node n0000's engine: the controller refuses it (acked, never acted on).
        await forger.emit(_forged(victim, node="node-2"))
        # A genuine fault after both: once its incident is over, the forged ones have long been read.
        await sim.fail(witness)
        await wait_for(lambda: _ended(store, witness), timeout=30, what="the genuine incident")
        await asyncio.sleep(0.5)
        assert await _incident(store, victim) is None
        assert sim.freeze_calls == 1 and sim.takeover_calls == 1  # the witness's only
        info = await bus.js.consumer_info(settings.stream_name, "controller-faults")
        assert info.num_ack_pending == 0 and info.num_redelivered == 0  # the forged fault was acked, not retried


async def test_an_event_whose_envelope_names_another_node_than_its_subject_never_reaches_a_handler(bus: Bus) -> None:
    seen: list[object] = []

    async def handler(env: object) -> None:
        seen.append(env)

    await bus.subscribe("fault.detected", handler)
    forged = bus.envelope(_forged("e-1", node="node-1"))  # the envelope says node-1 ...
    await bus.nc.publish(event_subject(bus.prefix, FaultDetected, "node-2"), forged.model_dump_json().encode())
    await bus.emit(_forged("e-2", node="node-2"))  # ... on node-2's subject; a genuine one of node-2's after it
    await wait_for(lambda: asyncio.sleep(0, seen), timeout=5, what="the genuine fault")
    assert [e.data.engine_id for e in seen] == ["e-2"] and bus.rejected == 1  # type: ignore[attr-defined]


def test_a_node_identity_may_publish_only_its_own_nodes_events() -> None:
    mine = nats_permissions("agent.node-1", "hf", "S").publish or ()
    assert event_subject("hf", FaultDetected, "node-1") in mine
    assert not [s for s in mine if "node-2" in s or s.startswith("hf.fault.detected") and not s.endswith(".node-1")]
    for identity in ("agent.node-1", "gpu_manager.node-1"):
        events = [s for s in nats_permissions(identity, "hf", "S").publish or () if not s.startswith(("$", "hf.node."))]
        assert events and all(s.endswith(".node-1") and "*" not in s and ">" not in s for s in events), events


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or token not in ("*", s[i]):
            return False
    return len(p) == len(s)


def test_the_consumers_may_fetch_from_their_pull_consumers_on_the_real_stream_name() -> None:
    for identity, durable in (("controller", "controller-faults"), ("dc_manager", "dc_manager-dc-1")):
        allowed = nats_permissions(identity, "hf", "HOLDFAST").publish or ()
        subject = f"$JS.API.CONSUMER.MSG.NEXT.HOLDFAST.{durable}"
        assert any(_matches(p, subject) for p in allowed), (identity, subject)
    assert not any(_matches(p, "$JS.API.CONSUMER.MSG.NEXT.HOLDFAST.x") for p in nats_permissions("router", "hf", "HOLDFAST").publish or ())


async def test_an_event_describing_another_nodes_engine_or_lease_never_reaches_a_handler(bus: Bus) -> None:
    """`engine.*` and `memory.*` events carry the record they describe: its node must be the subject's too, or a
    node could announce another node's engine as ready at an endpoint of its choosing (where the router would
    send users' prompts)."""
    seen: list[str] = []

    async def handler(env: Envelope) -> None:
        seen.append(env.type)

    for kind in ("engine.ready", "memory.lease.changed"):
        await bus.subscribe(kind, handler)
    theirs = EngineInfo(engine_id="e-1", node="node-1", model="m", engine_class="c", role=EngineRole.ACTIVE,
                        endpoint="http://127.0.0.1:9/evil", state="ready")
    lease = LeaseInfo(id="l-1", node="node-1", gpu=0, size=1, chunk_size=1, tag=Tag.WEIGHTS, owner="e-1",
                      engine_class="c", epoch=1, state=LeaseState.ACTIVE, created_at=0.0, last_seen=0.0)
    node2 = bus.settings.model_copy(update={"node": "node-2"})
    agent, gpu_manager = await Bus.connect(node2, "agent:node-2"), await Bus.connect(node2, "gpu_manager:node-2")
    try:  # each on node-2's own subjects (the only ones its identity may publish), describing node-1's records
        await agent.emit(EngineReady(engine=theirs), node="node-2")
        await gpu_manager.emit(LeaseChanged(lease=lease, from_state=None), node="node-2")
        await agent.emit(EngineReady(engine=theirs.model_copy(update={"node": "node-2"})))  # node-2's: genuine
        await wait_for(lambda: asyncio.sleep(0, seen), timeout=5, what="the genuine event")
        await asyncio.sleep(0.3)
    finally:
        await agent.close()
        await gpu_manager.close()
    assert seen == ["engine.ready"] and bus.rejected == 2  # type: ignore[attr-defined]


def test_the_vet_refuses_every_engine_an_event_names_on_another_node() -> None:
    engines = {"e-1": EngineInfo(engine_id="e-1", node="node-1", model="m", engine_class="c",
                                 role=EngineRole.ACTIVE, state="ready")}
    vet = engines_on_their_nodes(engines)
    mine = EngineInfo(engine_id="e-2", node="node-2", model="m", engine_class="c", role=EngineRole.ACTIVE,
                      state="ready")
    named = [EngineStopped(engine_id="e-1"), EngineReady(engine=engines["e-1"].model_copy(update={"node": "node-2"})),
             EngineReattached(incident_id=None, predecessor_id="e-1", engine=mine, used_standby=True),
             MemoryFrozen(owner="e-1", lease_ids=[], epoch=1)]
    for event in named:
        with pytest.raises(WrongNode):
            vet(Envelope(type=event.type, source="agent:node-2", node="node-2", data=event))
    vet(Envelope(type="engine.ready", source="agent:node-2", node="node-2", data=EngineReady(engine=mine)))  # its own: passes


async def test_another_nodes_agent_can_neither_reroute_nor_unroute_an_engine_it_does_not_run(
        bus: Bus, store: Store, settings: CommonSettings, settings_env: dict[str, str], tmp_path: Path) -> None:
    """On its own node's subjects, node-2's agent names node n0000's engine: as ready at an endpoint of its choosing
    (the router would send users' prompts there), and as stopped (its endpoint would be removed). Both refused."""
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=2)
    await sim.populate()
    await sim.serve()
    victim, witness = sim.engine_id("n0000", 0), sim.engine_id("n0000", 1)
    genuine = await store.get(f"endpoints/m/{victim}")
    assert genuine is not None
    forged = sim.engines[victim].model_copy(update={"node": "node-2", "endpoint": "http://127.0.0.1:9/evil"})
    async with control_plane(bus, store, service_env(settings_env), tmp_path), _agent_of(settings, "node-2") as forger:
        await forger.emit(EngineStopped(engine_id=victim))
        await forger.emit(EngineReady(engine=forged))
        await sim.fail(witness)  # a genuine incident after both: once it is over, the forged ones have been read
        await wait_for(lambda: _ended(store, witness), timeout=30, what="the genuine incident")
        await asyncio.sleep(0.5)
        assert await store.get(f"endpoints/m/{victim}") == genuine
        info = await bus.js.consumer_info(settings.stream_name, "controller-engines")
        assert info.num_ack_pending == 0 and info.num_redelivered == 0  # refused and acked, not retried
