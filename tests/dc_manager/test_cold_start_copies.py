"""A lost engine's cold start goes to the node that holds a copy of its class's weights (a peer lease first, then the
host tier, then an artifact), read from the GPU records the gpu_managers publish: the dc_manager's real intent path
against the simulated nodes (real NATS, real etcd)."""

from __future__ import annotations

import asyncio

from devstack.simcluster import GIB, SimulatedCluster
from libs.common.bus import Bus
from libs.common.cluster_view import ClusterView
from libs.common.config import CommonSettings
from libs.common.events import EngineSpec, IntentResult, RecoverIntent
from libs.common.store import Store
from services.dc_manager.executor import IntentExecutor
from services.dc_manager.settings import DcManagerSettings
from tests.controller.helpers import wait_for


async def fallback_result(bus: Bus, incident: str) -> IntentResult:
    """The fallback step's result of `incident`, once the dc_manager has published it."""
    async def fallback() -> IntentResult | None:
        got = [e.data for e in await bus.replay("intent.result")
               if isinstance(e.data, IntentResult) and e.data.incident_id == incident]
        return next((r for r in got if r.step == "fallback"), None)
    return await wait_for(fallback, what="the fallback result")


async def _cold_start_node(bus: Bus, store: Store, settings: CommonSettings, copies: dict[str, dict[str, str]],
                           incident: str) -> str:
    sim = SimulatedCluster(bus, store, nodes=3, gpus_per_node=1, emit_events=False, lease_bytes=GIB)
    await sim.populate()
    await sim.serve()
    for node, held in copies.items():  # what each node's gpu_manager publishes beside its capacity
        await store.put(f"gpus/{node}/0", {"healthy": True, "total_bytes": sim.gpu_bytes, "copies": held})
    await store.put("specs/sim", EngineSpec(engine_class="sim", model="m", command=["true"]))
    view = ClusterView()
    follow = asyncio.create_task(view.follow(store))
    try:
        await asyncio.wait_for(view.synced.wait(), 10)

        async def seen() -> bool:
            return all((n, 0) in view.gpus and view.gpus[(n, 0)].get("copies") == c for n, c in copies.items()) \
                and "sim" in view.specs
        await wait_for(seen, what="the copies in the view")
        executor = IntentExecutor(bus, store, view, DcManagerSettings(**settings.model_dump()))
        victim = sim.engine_id("n0000", 0)
        intent = RecoverIntent(incident_id=incident, engine_id=victim, model="m", engine_class="sim", node="n0000",
                               gpu=0, memory_lost=True)
        assert await executor.on_intents([bus.envelope(intent)]) == [None]
        result = await fallback_result(bus, incident)
        assert result.ok, result.detail
        return sim.engines[result.successor_id or ""].node
    finally:
        follow.cancel()


async def test_a_cold_start_goes_to_the_node_holding_a_host_copy_of_the_weights(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    node = await _cold_start_node(bus, store, settings, {"n0001": {"sim.weights": "artifact"},
                                                         "n0002": {"sim.weights": "host", "other.weights": "host"}},
                                  "inc-copies-host")
    assert node == "n0002"  # a host copy restores at PCIe speed: before the artifact on n0001, before n0000 itself


async def test_with_no_copy_anywhere_the_cold_start_stays_on_the_engines_own_node(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    node = await _cold_start_node(bus, store, settings, {"n0002": {"other.weights": "host"}}, "inc-copies-none")
    assert node == "n0000"  # another class's copy does not count; the home node has room


async def test_a_peer_copy_on_a_node_wins_over_a_host_copy_on_another(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    node = await _cold_start_node(bus, store, settings, {"n0001": {"sim.weights": "peer"},
                                                         "n0002": {"sim.weights": "host"}}, "inc-copies-peer")
    assert node == "n0001"  # another engine's live lease of the same weights: copied GPU to GPU (issue 22)
