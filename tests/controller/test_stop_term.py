"""The controller's own stops carry its leader term (issue 20), so that an agent can refuse those of a term that has
ended (tests/agent/test_stale_term.py): a drained node's engines, stopped once their successors serve, are stopped
with the leading controller's term. Real controller (admin API) and dc_manager processes, real NATS and etcd, the
node side simulated by real NATS responders; the stops are read off the wire as the agents would get them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from libs.common import procs
from libs.common.bus import Bus
from libs.common.events import StopEngine, command_subject
from libs.common.store import LeaderElection, Store
from tests.controller.helpers import control_plane, service_env, serving_cluster, wait_for

ADMIN = "admin-secret"


async def test_a_drained_nodes_engines_are_stopped_with_the_leaders_term(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = await serving_cluster(bus, store, nodes=2, gpus_per_node=1)
    stops: list[dict[str, Any]] = []

    async def heard(msg: Any) -> None:  # beside the simulated agent, which answers
        stops.append(json.loads(msg.data)["data"])

    await bus.nc.subscribe(command_subject(bus.prefix, "n0001", StopEngine), cb=heard)
    port = procs.free_port()
    env = service_env(settings_env, HF_API_ENABLED="true", HF_API_PORT=str(port), HF_ADMIN_TOKEN=ADMIN)
    async with control_plane(bus, store, env, tmp_path), \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        term = await LeaderElection.current_term(store, "controller")
        r = await c.post("/v1/nodes/n0001/drain")
        assert r.status_code == 202 and r.json()["engines"] == ["n0001-g0-e0"]
        await wait_for(lambda: _stopped(sim.stopped, "n0001-g0-e0"), what="the drained engine stopped")
        await wait_for(lambda: _stopped({s["engine_id"] for s in stops}, "n0001-g0-e0"), what="its stop heard")
    assert term > 0 and stops == [{"engine_id": "n0001-g0-e0", "term": term}]


async def _stopped(stopped: set[str], engine_id: str) -> bool:
    return engine_id in stopped
