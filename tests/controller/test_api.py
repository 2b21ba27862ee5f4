"""The admin API served by a real controller process over HTTP (its view from real etcd)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from devstack.simcluster import SimulatedCluster
from libs.common import procs
from libs.common.bus import Bus
from libs.common.events import LeaseState
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState, opened_record
from tests.controller.helpers import control_plane, service_env, wait_for

ADMIN, READER = "admin-secret", "read-secret"


@pytest.fixture
async def api(bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> AsyncIterator[tuple[str, SimulatedCluster]]:
    sim = SimulatedCluster(bus, store, nodes=3, gpus_per_node=2)
    await sim.populate()
    await sim.serve()
    port = procs.free_port()
    env = service_env(settings_env, HF_API_ENABLED="true", HF_API_PORT=str(port), HF_ADMIN_TOKEN=ADMIN,
                      HF_READ_TOKEN=READER)
    async with control_plane(bus, store, env, tmp_path, dc_manager=False):
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url) as c:
            await wait_for(lambda: _synced(c, 6), what="the API sees every engine")
        yield url, sim


async def _synced(c: httpx.AsyncClient, engines: int) -> bool:
    r = await c.get("/v1/engines", headers={"Authorization": f"Bearer {ADMIN}"})
    return r.status_code == 200 and r.json()["total"] == engines


def _client(url: str, token: str | None = ADMIN) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"} if token else {})


async def test_every_route_but_health_needs_a_token_and_writes_need_the_admin_one(api: tuple[str, SimulatedCluster]) -> None:
    url, sim = api
    async with _client(url, None) as anon, _client(url, "wrong") as bad, _client(url, READER) as ro:
        assert (await anon.get("/healthz")).status_code == 200
        assert (await anon.get("/metrics")).status_code == 200
        r = await anon.get("/v1/nodes")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"] == "unauthorized"
        assert (await bad.get("/v1/nodes")).status_code == 401
        assert (await ro.get("/v1/nodes")).status_code == 200
        r = await ro.post(f"/v1/engines/{sim.engine_id('n0000', 0)}/failover")
        assert r.status_code == 403 and r.json()["error"] == "forbidden"


async def test_lists_paginate_and_filter(api: tuple[str, SimulatedCluster]) -> None:
    url, _ = api
    async with _client(url) as c:
        first = (await c.get("/v1/gpus", params={"limit": 4})).json()
        assert first["total"] == 6 and len(first["items"]) == 4 and first["next_offset"] == 4
        rest = (await c.get("/v1/gpus", params={"limit": 4, "offset": 4})).json()
        assert len(rest["items"]) == 2 and rest["next_offset"] is None
        seen = {(g["node"], g["gpu"]) for g in first["items"] + rest["items"]}
        assert len(seen) == 6
        leases = (await c.get("/v1/leases", params={"node": "n0001", "state": "ACTIVE"})).json()
        assert leases["total"] == 2 and {x["node"] for x in leases["items"]} == {"n0001"}
        owner = (await c.get("/v1/leases", params={"owner": "n0002-g1-e0"})).json()
        assert [x["owner"] for x in owner["items"]] == ["n0002-g1-e0"]
        nodes = (await c.get("/v1/nodes")).json()
        assert [n["node"] for n in nodes["items"]] == ["n0000", "n0001", "n0002"]
        assert "holdfast_lease_bytes" in (await c.get("/metrics")).text


async def test_bad_parameters_are_422_with_a_body_that_says_what_is_wrong(api: tuple[str, SimulatedCluster]) -> None:
    url, sim = api
    async with _client(url) as c:
        r = await c.get("/v1/leases", params={"state": "MELTED"})
        assert r.status_code == 422 and r.json()["error"] == "validation_error" and "state" in r.json()["message"]
        r = await c.get("/v1/nodes", params={"limit": 0})
        assert r.status_code == 422 and "limit" in r.json()["message"]
        r = await c.post("/v1/engine-classes/sim/upgrade", json={"version": ""})
        assert r.status_code == 422 and "version" in r.json()["message"]


async def test_unknown_ids_are_404(api: tuple[str, SimulatedCluster]) -> None:
    url, _ = api
    async with _client(url) as c:
        for method, path in (("GET", "/v1/incidents/nope"), ("GET", "/v1/engines/nope"),
                             ("POST", "/v1/engines/nope/failover"), ("POST", "/v1/leases/nope/reclaim"),
                             ("POST", "/v1/nodes/nope/drain"), ("POST", "/v1/engine-classes/nope/upgrade")):
            r = await c.request(method, path, json={"version": "2"} if "upgrade" in path else None)
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"] == "not_found"


async def test_a_failover_during_an_open_incident_is_a_conflict(api: tuple[str, SimulatedCluster], store: Store) -> None:
    url, sim = api
    busy = sim.engine_id("n0001", 0)
    rec = opened_record(id=f"inc-{busy}-g0", engine_id=busy, model="m", state=IncidentState.REATTACHING,
                        deadline=time.time() + 600)
    await store.put(f"incidents/{rec.id}", rec)
    async with _client(url) as c:
        await wait_for(lambda: _engine_in_incident(c, busy), what="the view sees the incident")
        r = await c.post(f"/v1/engines/{busy}/failover")
        assert r.status_code == 409 and rec.id in r.json()["message"]
        lease = f"L-{busy}"
        r = await c.post(f"/v1/leases/{lease}/reclaim")
        assert r.status_code == 409  # reclaiming memory that an incident is recovering would lose it


async def _engine_in_incident(c: httpx.AsyncClient, engine: str) -> bool:
    r = await c.get(f"/v1/engines/{engine}")
    return r.status_code == 200 and r.json()["open_incident"] is not None


async def test_a_manual_failover_is_an_incident_and_a_second_one_conflicts(
        api: tuple[str, SimulatedCluster], store: Store) -> None:
    url, sim = api
    engine = sim.engine_id("n0002", 1)
    async with _client(url) as c:
        r = await c.post(f"/v1/engines/{engine}/failover", json={"successor": None})
        assert r.status_code == 202, r.text
        inc = r.json()
        assert inc["reason"] == "manual_failover" and inc["engine_id"] == engine
        rec = await store.get_model(f"incidents/{inc['id']}", IncidentRecord)
        assert rec is not None and rec.reason == "manual_failover"
        assert (await c.post(f"/v1/engines/{engine}/failover")).status_code == 409
        detail = await wait_for(lambda: _incident(c, inc["id"]), what="the incident in the API")
        assert detail["record"]["engine_id"] == engine and detail["timeline"][0]["step"] == "detect"


async def _incident(c: httpx.AsyncClient, inc_id: str) -> dict | None:
    r = await c.get(f"/v1/incidents/{inc_id}")
    return r.json() if r.status_code == 200 else None


async def test_a_forced_reclaim_goes_to_the_node_and_a_drain_marks_the_node(api: tuple[str, SimulatedCluster]) -> None:
    url, sim = api
    async with _client(url) as c:
        lease = f"L-{sim.engine_id('n0000', 1)}"
        r = await c.post(f"/v1/leases/{lease}/reclaim")
        assert r.status_code == 200 and r.json()["state"] == LeaseState.RECLAIMED
        r = await c.post("/v1/nodes/n0002/drain")
        assert r.status_code == 202 and r.json()["engines"] == ["n0002-g0-e0", "n0002-g1-e0"]

        async def drained() -> bool:
            nodes = (await c.get("/v1/nodes")).json()["items"]
            return any(n["node"] == "n0002" and n["drained"] for n in nodes)

        await wait_for(drained, what="the drain in the view")
        gpus = (await c.get("/v1/gpus", params={"node": "n0002"})).json()["items"]
        assert gpus and not any(g["healthy"] for g in gpus)  # placement will not use it


def test_the_openapi_schema_holds_under_generated_requests(bus: Bus, settings_env: dict[str, str], tmp_path: Path) -> None:
    """schemathesis: every operation, bounded examples, no 500s and responses as documented."""
    import hypothesis
    import schemathesis
    from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

    port = procs.free_port()
    env = service_env(settings_env, HF_API_ENABLED="true", HF_API_PORT=str(port), HF_ADMIN_TOKEN=ADMIN,
                      HF_INSTANCE="schema")
    from tests.controller.helpers import start

    child = start("services.controller", env, tmp_path / "c.log")
    try:
        procs.wait_port(port, child, timeout=30)
        url = f"http://127.0.0.1:{port}"
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        checks = [schemathesis.checks.not_a_server_error, status_code_conformance, response_schema_conformance]
        ran = 0
        for result in schema.get_all_operations():
            op = result.ok()

            @hypothesis.settings(max_examples=15, deadline=None, database=None,
                                 suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
            @hypothesis.given(case=op.as_strategy())
            def check(case: schemathesis.Case) -> None:
                case.call_and_validate(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, checks=checks)

            check()
            ran += 1
        assert ran >= 12
    finally:
        child.stop()


async def test_status_prints_the_cluster_as_tables(api: tuple[str, SimulatedCluster], capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every item, page after page (pages of 2 here: one page of 1,000 was all it showed, silently)."""
    import asyncio

    from services.controller import status_cli

    monkeypatch.setattr(status_cli, "PAGE", 2)
    url, sim = api
    await asyncio.to_thread(status_cli.status, url, READER)
    out = capsys.readouterr().out
    assert "incidents" in out
    for node in sim.node_names:
        for gpu in range(sim.gpus_per_node):
            assert sim.engine_id(node, gpu) in out and f"L-{sim.engine_id(node, gpu)}" in out, (node, gpu)
