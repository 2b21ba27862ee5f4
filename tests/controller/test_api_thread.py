"""The admin API and the incident pipeline share no event loop (issue 18, part 4): a controller set up in this
test's loop (which is then its pipeline's loop) keeps answering API requests while that loop is blocked; the
API's own view of etcd rides out an etcd stall as the main one does (a failed API thread would stop the
controller). Real NATS and etcd, a real HTTP client."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from devstack.simcluster import SimulatedCluster
from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import engine_record_key
from libs.common.service import Runtime
from libs.common.store import Store
from services.controller.app import setup
from services.controller.settings import ControllerSettings
from tests.controller.helpers import control_plane, service_env, serving_cluster, wait_for

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


async def test_the_api_rides_out_an_etcd_stall_and_answers_after_it(
        bus: Bus, stall_store: Store, stall_settings: CommonSettings, own_etcd: procs.Child, tmp_path: Path) -> None:
    """The API's own view follows etcd as the main one does: a stall past the leader's ttl ends neither it nor the
    process (a failed API thread would stop the controller), and the API answers from etcd again after it."""
    sim = await serving_cluster(bus, stall_store, nodes=1, gpus_per_node=2)
    port = procs.free_port()
    env = service_env(stall_settings.to_env(), HF_LEADER_TTL_S="1", HF_API_ENABLED="true", HF_API_PORT=str(port),
                      HF_ADMIN_TOKEN=ADMIN)
    async with control_plane(bus, stall_store, env, tmp_path, dc_manager=False) as children, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        await wait_for(lambda: _listed(c, len(sim.engines)), what="the API's view loaded")
        os.kill(own_etcd.pid, signal.SIGSTOP)
        await asyncio.sleep(6.0)  # six ttls
        os.kill(own_etcd.pid, signal.SIGCONT)
        await asyncio.sleep(3.0)
        assert children["c1"].alive(), f"controller exited with {children['c1'].returncode}"
        engine = sim.engine_id("n0000", 0)
        await stall_store.delete(engine_record_key(sim.engines[engine].node, engine))  # a change after the stall reaches the API's view
        await wait_for(lambda: _listed(c, len(sim.engines) - 1), timeout=30, what="the API's view following etcd")
        assert children["c1"].alive()
