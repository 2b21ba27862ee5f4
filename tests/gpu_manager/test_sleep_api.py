"""`POST /v1/engines/{id}/sleep` and `/wake` on a real controller reach the engine's node's gpu_manager and, through
its heartbeat, the engine; typed errors for an unknown engine (404) and a wrong state (409); `holdfast engine
sleep|wake` is the same call from the command line."""

from __future__ import annotations

import asyncio
import threading

from libs.client.memory import MemoryClient
from tests.gpu_manager.conftest import AdminApi

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


async def test_the_sleep_and_wake_routes_and_commands_reach_the_engine(manager_factory, admin_api: AdminApi):
    manager = manager_factory().start()
    client, kv_id = await asyncio.to_thread(sleepy_engine, manager)
    c = admin_api.http
    await admin_api.wait_lease_of("eng-api-sleep")
    r = await c.post("/v1/engines/eng-nobody/sleep", timeout=60)
    assert r.status_code == 404, r.text
    assert (await c.post("/v1/engines/eng-api-sleep/sleep", json={"level": 3})).status_code == 422
    assert (await c.post("/v1/engines/eng-api-sleep/wake")).status_code == 409  # not asleep
    r = await c.post("/v1/engines/eng-api-sleep/sleep", json={"level": 1, "timeout_s": 20}, timeout=40)
    assert r.status_code == 200, r.text
    assert r.json()["lease_ids"] == [kv_id] and r.json()["bytes"] == 2 * MIB
    again = await c.post("/v1/engines/eng-api-sleep/sleep", timeout=40)
    assert again.status_code == 409 and again.json()["error"] == "conflict"

    woke = await admin_api.cli("engine", "wake", "eng-api-sleep")
    assert woke.returncode == 0, woke.stdout + woke.stderr
    assert '"state": "awake"' in woke.stdout
    refused = await admin_api.cli("engine", "wake", "eng-api-sleep")
    assert refused.returncode == 1 and "not asleep" in refused.stdout
    slept = await admin_api.cli("engine", "sleep", "eng-api-sleep", "--level", "1")
    assert slept.returncode == 0, slept.stdout + slept.stderr
    client.close()
