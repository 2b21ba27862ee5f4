"""A regroup the dc_manager cannot carry out touches nothing: the engine itself is the fallback's successor, routed
back in, and serves on (services/dc_manager/steps.py `_regroup`): the real intent path against simulated nodes (real
NATS, real etcd). Not a degraded engine (its spec has as many ranks as it runs), and a degraded one whose node has
no room for a whole group: neither is frozen, stopped or replaced."""

from __future__ import annotations

import asyncio
import logging

import pytest

from devstack.simcluster import GIB, SimulatedCluster
from libs.common.bus import Bus
from libs.common.cluster_view import ClusterView
from libs.common.config import CommonSettings
from libs.common.events import EngineSpec, IncidentReason, IntentResult, RecoverIntent, Tag
from libs.common.store import Store
from services.dc_manager.executor import IntentExecutor
from services.dc_manager.settings import DcManagerSettings
from tests.controller.helpers import wait_for


@pytest.mark.parametrize(("spec_tp", "why"), [(1, "not a degraded engine"), (2, "no whole group of 2 on n0000")],
                         ids=["not-degraded", "no-room"])
async def test_a_regroup_that_cannot_be_placed_leaves_the_engine_serving_as_its_own_successor(
        bus: Bus, store: Store, settings: CommonSettings, caplog: pytest.LogCaptureFixture, spec_tp: int,
        why: str) -> None:
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=2, emit_events=False, lease_bytes=GIB)
    await sim.populate()
    await sim.serve()
    victim = sim.engine_id("n0000", 0)
    # the simulated engine made a batched one with its KV backup (host memory), one engine of a spec of `spec_tp`
    engine = sim.engines[victim].model_copy(update={"engine_class": "batched", "state": "ready"})
    await store.put(f"engines/n0000/{victim}", engine)
    backup = next(iter(sim.leases.values())).model_copy(update={"id": "rg-backup", "name": "kv_backup", "host": True,
                                                                "tag": Tag.OTHER, "owner": victim, "size": GIB // 8})
    await store.put(f"allocations/n0000/{backup.id}", backup)
    for gpu in (0, 1):  # two healthy GPUs, each too small for half of the engine's memory
        await store.put(f"gpus/n0000/{gpu}", {"healthy": True, "total_bytes": GIB // 4})
    await store.put("specs/batched", EngineSpec(engine_class="batched", model="m", command=["true"], tp=spec_tp))
    view = ClusterView()
    follow = asyncio.create_task(view.follow(store))
    try:
        await asyncio.wait_for(view.synced.wait(), 10)

        async def seen() -> bool:
            return "batched" in view.specs and "rg-backup" in view.leases and \
                view.gpus.get(("n0000", 1), {}).get("total_bytes") == GIB // 4
        await wait_for(seen, what="the spec, the backup and the GPUs in the view")
        executor = IntentExecutor(bus, store, view, DcManagerSettings(**settings.model_dump()))
        intent = RecoverIntent(incident_id=f"inc-rg-{spec_tp}", engine_id=victim, model="m", engine_class="batched",
                               node="n0000", gpu=0, memory_lost=True, reason=IncidentReason.REGROUP)
        with caplog.at_level(logging.WARNING, logger="holdfast.dc_manager"):
            assert await executor.on_intents([bus.envelope(intent)]) == [None]

            async def fallback() -> IntentResult | None:
                got = [e.data for e in await bus.replay("intent.result")
                       if isinstance(e.data, IntentResult) and e.data.incident_id == intent.incident_id]
                return next((r for r in got if r.step == "fallback"), None)
            result = await wait_for(fallback, what="the fallback result")
    finally:
        follow.cancel()
    assert result.ok and result.successor_id == victim  # it serves on, routed back in
    assert any(f"{victim} not regrouped, it serves on: " in r.message and why in r.message for r in caplog.records)
    assert sim.freeze_calls == 0 and not sim.takeovers  # nothing frozen, nothing taken over
