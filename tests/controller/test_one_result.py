"""The dc_manager's one result per intent (a prompt takeover): the controller still records the freeze and
the reattach as two steps, split at the freeze's own time (`IntentResult.frozen_at`)."""

from __future__ import annotations

from pathlib import Path

from devstack.simcluster import SimulatedCluster
from libs.common.bus import Bus
from libs.common.events import IntentResult
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState
from tests.controller.helpers import control_plane, service_env, wait_for


async def test_one_reattach_result_ends_the_freeze_at_its_recorded_time_and_starts_the_reattach_there(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    # No memory.frozen from the node side: the intent's result is all the controller hears of the freeze.
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=1, emit_events=False)
    await sim.populate()
    await sim.serve()
    async with control_plane(bus, store, service_env(settings_env), tmp_path):
        victim = sim.engine_id("n0000", 0)
        await sim.fail(victim)
        inc_id = f"inc-{victim}-g0"

        async def resolved() -> IncidentRecord | None:
            raw = await store.get_model(f"incidents/{inc_id}", IncidentRecord)
            return raw if raw is not None and raw.state is IncidentState.RESOLVED else None

        rec = await wait_for(resolved, what="resolved")
        results = [e.data for e in await bus.replay("intent.result") if isinstance(e.data, IntentResult)]
        assert [(r.step, r.ok) for r in results] == [("reattach", True)]
        frozen_at = results[0].frozen_at
        assert frozen_at is not None
        freeze, reattach = rec.steps["freeze"], rec.steps["reattach"]  # type: ignore[index]
        assert freeze.status == "done" and reattach.status == "done"
        assert freeze.ended_at == frozen_at == reattach.started_at
        assert freeze.started_at <= frozen_at <= (reattach.ended_at or 0.0)
        assert set(rec.timings_ms()) >= {"detect", "route_out", "freeze", "reattach", "route_in", "total"}
