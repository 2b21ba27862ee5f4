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
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import FaultDetected, FaultKind, event_subject
from libs.common.security.policy import nats_permissions
from libs.common.store import Store
from services.controller.incident import IncidentRecord, incident_id_for
from tests.controller.helpers import control_plane, wait_for


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
    async with control_plane(bus, store, settings_env, tmp_path), _agent_of(settings, "node-2") as forger:
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
