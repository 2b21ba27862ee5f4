"""A successor that serves before its predecessor's memory is frozen (a shadow promoted while the freeze runs)
is routed in, and its incident resolved, only once the freeze ends: never with the memory unfrozen."""

from __future__ import annotations

import asyncio
from pathlib import Path

from devstack.simcluster import SimulatedCluster
from libs.common.bus import Bus
from libs.common.events import EndpointAdded, EngineInfo, EngineReattached, EngineRole, MemoryFrozen
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState
from tests.controller.helpers import control_plane, service_env, wait_for


async def test_an_early_successor_is_routed_in_when_the_memory_is_frozen_not_before(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=1, emit_events=False)
    await sim.populate()  # no dc_manager and no node answering: the events below are all the controller hears
    async with control_plane(bus, store, service_env(settings_env), tmp_path, dc_manager=False):
        victim = sim.engine_id("n0000", 0)
        inc_id = f"inc-{victim}-g0"
        await sim.fail(victim)

        async def record() -> IncidentRecord | None:
            return await store.get_model(f"incidents/{inc_id}", IncidentRecord)

        async def freezing() -> IncidentRecord | None:
            got = await record()
            return got if got is not None and got.state is IncidentState.FREEZING else None

        await wait_for(freezing, what="the incident waiting on its freeze")
        successor = EngineInfo(engine_id="shadow-1", node="n0000", model="m", engine_class="sim",
                               role=EngineRole.ACTIVE, gpu=0, endpoint="http://127.0.0.1:9/shadow-1", state="ready")
        await bus.emit(EngineReattached(incident_id=inc_id, predecessor_id=victim, engine=successor, used_standby=True))
        await asyncio.sleep(1.0)

        async def added() -> list[EndpointAdded]:
            return [e.data for e in await bus.replay("router.endpoint.added") if isinstance(e.data, EndpointAdded)]

        assert await added() == []
        rec = await record()
        assert rec is not None and rec.state is IncidentState.FREEZING

        await bus.emit(MemoryFrozen(owner=victim, lease_ids=[f"L-{victim}"], epoch=2, incident_id=inc_id),
                       node="n0000")  # as the victim's node's gpu_manager

        async def resolved() -> IncidentRecord | None:
            got = await record()
            return got if got is not None and got.state is IncidentState.RESOLVED else None

        rec = await wait_for(resolved, what="the incident resolved by the freeze's end")
        assert rec.successor_id == "shadow-1"
        assert [(e.engine_id, e.incident_id) for e in await added()] == [("shadow-1", inc_id)]
        freeze, reattach = rec.steps["freeze"], rec.steps["reattach"]  # type: ignore[index]
        assert freeze.status == reattach.status == "done" and (freeze.ended_at or 0) <= (reattach.ended_at or 0)
