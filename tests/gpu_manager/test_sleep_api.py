"""`POST /v1/engines/{id}/sleep` and `/wake` on a real controller reach the engine's node's gpu_manager and, through
its heartbeat, the engine; typed errors for an unknown engine (404) and a wrong state (409); `holdfast engine
sleep|wake` is the same call from the command line."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from libs.client.memory import MemoryClient
from libs.common import procs
from tests.controller.helpers import control_plane, service_env, wait_for

ADMIN = "admin-secret"
MIB = 1024 * 1024


def sleepy_engine(manager) -> tuple[MemoryClient, str]:  # noqa: ANN001
    c = MemoryClient.connect("eng-api-sleep", socket_path=manager.socket)
    kv = c.allocate(2 * MIB, tag="kv_cache", name="kv")
    c.register([kv.meta("kv", "uint8", (2 * MIB,))])
    c.commit()

    def on_ask(ask) -> None:  # noqa: ANN001
        def act() -> None:
            (c.sleep if ask.op == "sleep" else c.wake)([kv.id], ask=ask.id)
            c.answer(ask.id)

        threading.Thread(target=act).start()

    c.on_ask = on_ask
    c.start_heartbeats(0.05)
    return c, kv.id


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "holdfast.main", "engine", *args, "--api-url", url, "--token", ADMIN],
                          capture_output=True, text=True, timeout=60)


async def test_the_sleep_and_wake_routes_and_commands_reach_the_engine(manager_factory, bus, store, settings_env,
                                                                      tmp_path: Path):
    manager = manager_factory().start()
    client, kv_id = await asyncio.to_thread(sleepy_engine, manager)
    port = procs.free_port()
    env = service_env(settings_env, HF_API_ENABLED="true", HF_API_PORT=str(port), HF_ADMIN_TOKEN=ADMIN)
    async with control_plane(bus, store, env, tmp_path, dc_manager=False):
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            async def seen() -> bool:
                r = await c.get("/v1/leases", params={"owner": "eng-api-sleep"})
                return r.status_code == 200 and r.json()["total"] == 1

            await wait_for(seen, what="the engine's lease in the API's view")
            r = await c.post("/v1/engines/eng-nobody/sleep", timeout=60)
            assert r.status_code == 404, r.text
            assert (await c.post("/v1/engines/eng-api-sleep/sleep", json={"level": 3})).status_code == 422
            assert (await c.post("/v1/engines/eng-api-sleep/wake")).status_code == 409  # not asleep
            r = await c.post("/v1/engines/eng-api-sleep/sleep", json={"level": 1, "timeout_s": 20}, timeout=40)
            assert r.status_code == 200, r.text
            assert r.json()["lease_ids"] == [kv_id] and r.json()["bytes"] == 2 * MIB
            again = await c.post("/v1/engines/eng-api-sleep/sleep", timeout=40)
            assert again.status_code == 409 and again.json()["error"] == "conflict"

        woke = await asyncio.to_thread(cli, url, "wake", "eng-api-sleep")
        assert woke.returncode == 0, woke.stdout + woke.stderr
        assert '"state": "awake"' in woke.stdout
        refused = await asyncio.to_thread(cli, url, "wake", "eng-api-sleep")
        assert refused.returncode == 1 and "not asleep" in refused.stdout
        slept = await asyncio.to_thread(cli, url, "sleep", "eng-api-sleep", "--level", "1")
        assert slept.returncode == 0, slept.stdout + slept.stderr
    client.close()
