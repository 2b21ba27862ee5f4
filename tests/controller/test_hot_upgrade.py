"""Rolling hot upgrade end to end: real agent + pattern engines, gpu_manager (host backend), controller, dc_manager."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from libs.common.bus import Bus
from libs.common.events import EngineRole, Envelope, ListEngines, ListEnginesReply
from libs.common.service import check_health
from libs.common.store import Store
from services.controller.incident import IncidentRecord
from tests.agent.conftest import AgentProcess, Recorder, agent, gpu_manager, pattern_spec, recorder  # noqa: F401 - fixtures
from tests.controller.helpers import control_plane, service_env, wait_for
from tests.gpu_manager.harness import ManagerProc

NBYTES = 4 << 20
TOKEN = "upgrade-admin"


async def _checksum(endpoint: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{endpoint}/checksum", timeout=10)).json()


async def _engines(bus: Bus) -> ListEnginesReply:
    return await bus.request("node-1", ListEngines(), ListEnginesReply, timeout=5)


async def test_a_rolling_hot_upgrade_moves_each_engine_to_the_new_version_one_at_a_time_with_its_memory(
        gpu_manager: ManagerProc, agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store,  # noqa: F811
        settings_env: dict[str, str], tmp_path: Path) -> None:
    env = {"HF_PATTERN_BYTES": str(NBYTES)}
    agent.start([pattern_spec(replicas=2, standbys=1, env=env, version="1"),
                 pattern_spec(replicas=0, standbys=1, env=env, version="2")], takeover_wait_s=60)
    await agent.wait_up(store)
    for sub in ("router.>", "incident.>"):
        await bus.subscribe(sub, recorder.handler)

    async def warm() -> list[Any] | None:
        engines = (await _engines(bus)).engines
        ready = [e for e in engines if e.state in ("ready", "standby")]
        return engines if len(ready) == 4 else None

    engines = await wait_for(warm, 30, "two v1 engines and a standby of each version")
    olds = sorted((e for e in engines if e.role is EngineRole.ACTIVE), key=lambda e: e.engine_id)
    assert [e.version for e in olds] == ["1", "1"]
    before = {e.engine_id: await _checksum(e.endpoint) for e in olds}

    cp_env = service_env(settings_env, HF_API_ENABLED="true", HF_API_PORT="0", HF_ADMIN_TOKEN=TOKEN)
    async with control_plane(bus, store, cp_env, tmp_path):
        api = (await check_health(bus, "controller", "c1", timeout=2)).detail["api"]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=api, headers=auth, timeout=10) as http:
            async def seen() -> bool:  # the controller's view has both engines before the roll-out is asked
                r = await http.get("/v1/engines", params={"engine_class": "pattern"})
                return sum(1 for e in r.json()["items"] if e["role"] == "active") == 2

            await wait_for(seen, 20, "the controller's view of the engines")
            r = await http.post("/v1/engine-classes/pattern/upgrade", json={"version": "2"})
            assert r.status_code == 202, r.text
            assert r.json()["state"] == "running"
            again = await http.post("/v1/engine-classes/pattern/upgrade", json={"version": "2"})
            assert again.status_code == 409  # one roll-out of a class at a time

            async def finished() -> dict[str, Any] | None:
                out = (await http.get("/v1/engine-classes/pattern/upgrade")).json()
                return out if out["state"] != "running" else None

            out = await wait_for(finished, 45, "the roll-out to finish")

        assert out["state"] == "done", out
        assert [s["engine_id"] for s in out["steps"]] == [e.engine_id for e in olds]
        assert all(s["state"] == "done" and s["successor_id"] for s in out["steps"])
        incidents = [IncidentRecord.model_validate_json(await store.get(f"incidents/{s['incident_id']}"))
                     for s in out["steps"]]
        assert [i.reason.value for i in incidents] == ["hot_upgrade", "hot_upgrade"]
        assert all(i.state.value == "resolved" for i in incidents)
        # One at a time: the second incident opened after the first one resolved.
        assert incidents[1].opened_at >= incidents[0].updated_at

        for inc, old in zip(incidents, olds, strict=True):
            reattached = await recorder.wait("engine.reattached", lambda e, i=inc: e.incident_id == i.id)
            assert reattached.predecessor_id == old.engine_id and reattached.engine.version == "2"
            after = await _checksum(reattached.engine.endpoint)
            assert after["engine_id"] == reattached.engine.engine_id
            assert after["sha256"] == before[old.engine_id]["sha256"] and after["pattern_ok"]
            removed = [e for e in recorder.events if e.type == "router.endpoint.removed" and e.data.engine_id == old.engine_id]
            added = [e for e in recorder.events if e.type == "router.endpoint.added"
                     and e.data.engine_id == reattached.engine.engine_id]
            # announced once, by its incident's route-in (not again as "a ready engine in no incident")
            # one event each; the bus delivers at least once, so a redelivery carries the same envelope id
            assert len({e.id for e in removed}) == 1 and len({e.id for e in added}) == 1
            assert removed[0].data.live  # a sound engine: routers leave its streams running until it stops
            assert added[0].data.incident_id == inc.id
            assert _index(recorder.events, removed[0]) < _index(recorder.events, added[0])

        # The agent's desired state followed: two v2 engines and a v2 standby, no v1 engine left or restarted.
        async def settled() -> list[Any] | None:
            engines = (await _engines(bus)).engines
            live = [(e.role.value, e.version) for e in engines if e.state in ("ready", "standby")]
            return engines if sorted(live) == [("active", "2"), ("active", "2"), ("standby", "2")] \
                and len(engines) == 3 else None

        await wait_for(settled, 20, "two v2 engines and one v2 standby")
        started_v1 = [e for e in recorder.of("engine.started") if e.engine.version == "1"]
        assert len(started_v1) == 3  # the two original engines and the original standby: nothing after
    await asyncio.sleep(0)


def _index(events: list[Envelope], env: Envelope) -> int:
    return next(i for i, e in enumerate(events) if e is env)
