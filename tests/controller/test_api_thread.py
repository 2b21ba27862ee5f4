"""The admin API and the incident pipeline share no event loop (issue 18, part 4): a controller set up in this
test's loop (which is then its pipeline's loop) keeps answering API requests while that loop is blocked, and
still answers them from its own view of etcd, leader or not. Real NATS and etcd, a real HTTP client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from bench.controlplane import SimulatedCluster
from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.service import Runtime
from libs.common.store import Store
from services.controller.app import setup
from services.controller.settings import ControllerSettings
from tests.controller.helpers import serving_cluster, wait_for

ADMIN = "admin-secret"
BLOCK_S = 3.0


@pytest.fixture
async def controller(settings: CommonSettings, bus: Bus, store: Store) -> AsyncIterator[tuple[str, SimulatedCluster]]:
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2)
    port = procs.free_port()
    cs = ControllerSettings(**settings.model_dump(), instance="c-iso", api_port=port, admin_token=ADMIN)
    rt = Runtime("controller", cs.instance, cs)
    await rt.start()
    try:
        await setup(rt, cs)
        yield f"http://127.0.0.1:{port}", sim
    finally:
        rt.stopping.set()
        await rt.close()


def _timed_get(url: str, out: dict[str, float | int]) -> None:
    r = httpx.get(f"{url}/v1/engines", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=BLOCK_S * 4)
    out["status"], out["engines"], out["at"] = r.status_code, r.json()["total"], time.monotonic()


async def test_the_api_answers_while_the_pipelines_loop_is_blocked(
        controller: tuple[str, SimulatedCluster]) -> None:
    url, sim = controller
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        page = await wait_for(lambda: _listed(c, len(sim.engines)), what="the API's view loaded")
    assert page == len(sim.engines)
    out: dict[str, float | int] = {}
    client = threading.Thread(target=_timed_get, args=(url, out))
    started = time.monotonic()
    client.start()
    time.sleep(BLOCK_S)  # blocks this loop, the controller's main loop: its view, its pipeline, its health
    unblocked = time.monotonic()
    await asyncio.to_thread(client.join, BLOCK_S * 4)  # the loop free again: before, the API answers now
    assert out.get("status") == 200 and out["engines"] == len(sim.engines)
    # Answered before the main loop was free again: no part of the request waited for it.
    assert out["at"] < unblocked, f"answered {out['at'] - started:.2f} s after the request, the loop blocked {unblocked - started:.2f} s"


async def _listed(c: httpx.AsyncClient, want: int) -> int | None:
    try:
        r = await c.get("/v1/engines")
    except httpx.HTTPError:
        return None
    return want if r.status_code == 200 and r.json()["total"] == want else None
