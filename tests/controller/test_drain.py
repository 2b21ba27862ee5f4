"""Draining a node moves its serving engines off it: real controller (admin API) and dc_manager processes,
real NATS and etcd, the node side simulated by real NATS responders."""

from __future__ import annotations

from pathlib import Path

import httpx

from devstack.simcluster import SimulatedCluster
from libs.common import procs
from libs.common.bus import Bus
from libs.common.events import EndpointAdded, EndpointRemoved
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState
from tests.controller.helpers import control_plane, service_env, serving_cluster, wait_for

ADMIN = "admin-secret"


async def _resolved(store: Store, inc_ids: list[str]) -> list[IncidentRecord] | None:
    recs = [await store.get_model(f"incidents/{i}", IncidentRecord) for i in inc_ids]
    return recs if all(r is not None and r.state is IncidentState.RESOLVED for r in recs) else None  # type: ignore[return-value]


async def test_a_drained_node_has_its_engines_cold_started_elsewhere_routed_in_first_then_stopped(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = await serving_cluster(bus, store, nodes=3, gpus_per_node=2)
    port = procs.free_port()
    env = service_env(settings_env, HF_API_ENABLED="true", HF_API_PORT=str(port), HF_ADMIN_TOKEN=ADMIN)
    async with control_plane(bus, store, env, tmp_path), \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        r = await c.post("/v1/nodes/n0001/drain")
        assert r.status_code == 202
        moved = ["n0001-g0-e0", "n0001-g1-e0"]
        assert r.json()["engines"] == moved and len(r.json()["incidents"]) == 2
        recs = await wait_for(lambda: _resolved(store, r.json()["incidents"]), what="both engines moved off")
        assert (await c.post("/v1/nodes/n0001/drain")).json()["incidents"] == []  # nothing started twice

        for rec in recs:
            assert rec.move_off and rec.fallback and not rec.memory_lost
            assert rec.steps["route_out"].status == "skipped" and rec.steps["fallback"].status == "done"
            assert "freeze" not in rec.steps and sim.freeze_calls == 0  # memory stays on its node: nothing frozen
            successor = sim.engines[rec.successor_id or ""]
            assert successor.node != "n0001" and successor.state == "ready"
            assert await store.get(f"endpoints/m/{rec.successor_id}") is not None
            assert await store.get(f"endpoints/m/{rec.engine_id}") is None

        stopped = await wait_for(lambda: _stopped(sim, moved), what="the drained engines stopped")
        assert stopped
        # Make before break: each successor's route is announced before its predecessor's goes.
        events = await bus.replay("router.endpoint.>")
        for rec in recs:
            order = [type(e.data) for e in events if e.incident_id == rec.id]
            assert order == [EndpointAdded, EndpointRemoved]


async def _stopped(sim: SimulatedCluster, engines: list[str]) -> bool:
    return set(engines) <= sim.stopped
