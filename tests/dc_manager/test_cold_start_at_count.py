"""A cold start is not sent to a node whose agent runs the spec's count of active engines already: that agent refuses
one more (supervision.admit_active), and a lost node's replica placed on the one node that served the model too was
refused there and its incident failed (multi-node probe of 2026-12-07, finding 2). The dc_manager's real intent path
against simulated nodes (real NATS, real etcd)."""

from __future__ import annotations

import asyncio

from devstack.simcluster import GIB, SimulatedCluster
from libs.common.bus import Bus
from libs.common.cluster_view import ClusterView
from libs.common.config import CommonSettings
from libs.common.events import EngineInfo, EngineSpec, IntentResult, RecoverIntent, engine_record_key
from libs.common.ids import cold_engine_id, spec_key
from libs.common.store import Store
from services.dc_manager.executor import IntentExecutor
from services.dc_manager.settings import DcManagerSettings
from tests.controller.helpers import wait_for
from tests.dc_manager.test_cold_start_copies import fallback_result

KEY = spec_key("m", "sim", "1")


async def _fallback(bus: Bus, store: Store, settings: CommonSettings, at_count: list[str],
                    incident: str, *, node_lost: bool = False) -> IntentResult:
    """n0000's engine lost with its memory (`node_lost`: with its node, gone from etcd); n0001 holds a host copy of
    the weights (placement's first choice); the nodes `at_count` run this spec's one replica already."""
    sim = SimulatedCluster(bus, store, nodes=3, gpus_per_node=1, emit_events=False, lease_bytes=GIB)
    await sim.populate()
    await sim.serve()
    if node_lost:
        await store.delete("nodes/n0000")
    await store.put("gpus/n0001/0", {"healthy": True, "total_bytes": sim.gpu_bytes, "copies": {"sim.weights": "host"}})
    await store.put("specs/sim", EngineSpec(engine_class="sim", model="m", command=["true"]))
    for node in at_count:
        eid = sim.engine_id(node, 0)
        await store.put(engine_record_key(node, eid), sim.engines[eid].model_copy(update={"spec_key": KEY}))
        await store.put(f"agents/{node}/specs/{KEY}", EngineSpec(engine_class="sim", model="m", command=["true"],
                                                                 replicas=1))
    view = ClusterView()
    follow = asyncio.create_task(view.follow(store))
    try:
        await asyncio.wait_for(view.synced.wait(), 10)

        async def seen() -> bool:
            counted = all(view.engines[sim.engine_id(n, 0)].spec_key == KEY for n in at_count)
            return counted and "sim" in view.specs and (view.gpus.get(("n0001", 0)) or {}).get("copies") is not None \
                and len(view.agent_specs) == len(at_count) and (not node_lost or "n0000" not in view.nodes)
        await wait_for(seen, what="the specs and records in the view")
        executor = IntentExecutor(bus, store, view, DcManagerSettings(**settings.model_dump()))
        intent = RecoverIntent(incident_id=incident, engine_id=sim.engine_id("n0000", 0), model="m",
                               engine_class="sim", node="n0000", gpu=0, memory_lost=True)
        assert await executor.on_intents([bus.envelope(intent)]) == [None]
        result = await fallback_result(bus, incident)
        if result.ok:
            assert isinstance(sim.engines[result.successor_id or ""], EngineInfo)
        return result
    finally:
        follow.cancel()


async def test_a_cold_start_skips_a_node_at_its_count_even_one_holding_a_copy(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    result = await _fallback(bus, store, settings, ["n0001"], "inc-at-count")
    assert result.ok, result.detail
    assert result.node == "n0000", result  # not n0001 (its copy would have won): its agent refuses a second


async def test_with_every_node_left_at_its_count_the_fallback_fails_saying_so(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    result = await _fallback(bus, store, settings, ["n0001", "n0002"], "inc-all-at-count", node_lost=True)
    assert not result.ok and "running their count of this spec already: n0001, n0002" in (result.detail or ""), \
        result


async def test_the_failed_engine_is_not_counted_its_node_takes_its_cold_start(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    """Its record still says ready until its agent's write lands (a clean-clone run's second GPU fault on a one-node
    stack failed its fallback so: its node counted at its count by the very engine being replaced)."""
    result = await _fallback(bus, store, settings, ["n0000", "n0001", "n0002"], "inc-replaced-counted")
    assert result.ok and result.node == "n0000", result


async def test_an_intent_sent_again_asks_the_node_its_cold_start_began_on_not_a_new_one(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    """A new leader sends an intent again before its progress record was written: its cold start, begun on n0002,
    is asked for there (the agent answers the engine started), never placed anew (the host copy on n0001 would win
    and a second engine of that id start there)."""
    incident = "inc-sent-again"
    sim = SimulatedCluster(bus, store, nodes=3, gpus_per_node=1, emit_events=False, lease_bytes=GIB)
    await sim.populate()
    await sim.serve()
    await store.put("gpus/n0001/0", {"healthy": True, "total_bytes": sim.gpu_bytes, "copies": {"sim.weights": "host"}})
    await store.put("specs/sim", EngineSpec(engine_class="sim", model="m", command=["true"]))
    began = sim.engines[sim.engine_id("n0002", 0)].model_copy(update={"engine_id": cold_engine_id(incident)})
    await store.put(engine_record_key("n0002", began.engine_id), began)
    view = ClusterView()
    follow = asyncio.create_task(view.follow(store))
    try:
        await asyncio.wait_for(view.synced.wait(), 10)

        async def seen() -> bool:
            return began.engine_id in view.engines and "sim" in view.specs \
                and (view.gpus.get(("n0001", 0)) or {}).get("copies") is not None
        await wait_for(seen, what="the begun cold start in the view")
        sent: list[str] = []
        executor = IntentExecutor(bus, store, view, DcManagerSettings(**settings.model_dump()))
        real = executor.steps._command

        async def command(step, node, cmd, reply, wait_s, **kw):  # noqa: ANN001, ANN003, ANN202
            sent.append(node)
            return await real(step, node, cmd, reply, wait_s, **kw)
        executor.steps._command = command  # type: ignore[method-assign]
        intent = RecoverIntent(incident_id=incident, engine_id=sim.engine_id("n0000", 0), model="m",
                               engine_class="sim", node="n0000", gpu=0, memory_lost=True)
        assert await executor.on_intents([bus.envelope(intent)]) == [None]
        assert sent and set(sent) == {"n0002"}, sent
    finally:
        follow.cancel()
