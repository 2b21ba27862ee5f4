"""A router out of file descriptors (probe of 2026-12-07). asyncio's accept loop reported each failed accept with
its traceback, 2048 a pass: 12-49 thousand log lines a second, a gigabyte in nine minutes, while its health said
ok; and its requests that needed a new connection to an engine failed as 502, the healthy engine marked suspect.
Now: one warning an episode, health not ok with the reason, the engine never blamed (503
`router_out_of_resources`), and new clients served again once descriptors free up. A real router (its limit
lowered with prlimit), a real engine, real sockets.

The router keeps a connection to the engine it served from, and opens spares ahead of need (spare.py): a request
while it has no descriptor left may well find one open. So its spares are off here and several requests come at
once, over client connections opened before the limit: one engine connection kept can carry one of them at a time,
the others need new ones (a single request was answered 200 over the kept one in a clean-clone run of cb1d671)."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import nats.errors

from libs.common.service import check_health
from tests.gpu_manager.harness import until
from tests.router.conftest import EngineProc, RouterProc
from tests.router.test_router import MODEL

HOGS = 40
AT_ONCE = 8  # requests sent together while the router has no descriptor left


async def _health(bus) -> dict[str, Any] | None:  # noqa: ANN001
    try:
        return (await check_health(bus, "router", timeout=3)).model_dump()
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return None


async def test_a_router_out_of_fds_says_so_once_blames_no_engine_and_serves_again(
        engines: Callable[[str], EngineProc], start_router: Callable[..., RouterProc], store, bus) -> None:  # noqa: ANN001
    engine = engines("oa-a")
    await asyncio.to_thread(engine.wait_ready)
    await store.put(f"endpoints/{MODEL}/oa-a", engine.url)
    router = await asyncio.to_thread(start_router, hold_timeout_s=2, engine_spare_connections=0)
    pid, port = router.child.pid, int(router.url.rsplit(":", 1)[1])
    log_path = router.child.log_path
    limits = httpx.Limits(max_connections=AT_ONCE, max_keepalive_connections=AT_ONCE)
    async with httpx.AsyncClient(base_url=router.url, timeout=30, limits=limits) as c:
        await asyncio.gather(*(c.get("/stats") for _ in range(AT_ONCE)))  # its connections open before the limit
        body = {"model": MODEL, "prompt": "x", "max_tokens": 8}
        assert (await c.post("/v1/completions", json=body)).status_code == 200  # a router that has served
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")), hard))  # none left
        hogs: list[socket.socket] = []
        try:
            for _ in range(HOGS):  # connected in the listen backlog; the router cannot accept them
                hogs.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            reply = await until(lambda: _troubled(bus), timeout=20)
            assert not reply["ok"] and "EMFILE" in reply["detail"]["accept_trouble"], reply
            replies = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(AT_ONCE)))
            codes = [(r.status_code, r.json().get("error", {}).get("code")) for r in replies]
            assert (503, "router_out_of_resources") in codes, codes  # new engine connections: none to be had
            assert set(codes) <= {(200, None), (503, "router_out_of_resources")}, codes
            stats = (await c.get("/stats")).json()
            assert not any(e["suspect"] for eps in stats["endpoints"].values() for e in eps), stats
            await asyncio.sleep(3)  # asyncio retries every second: three passes of 2048 failed accepts
        finally:
            for s in hogs:
                s.close()
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as fresh:  # a new client: accepted again
            done = await fresh.post("/v1/completions", json=body)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8, done.text
        assert time.monotonic() - t0 < 10
    reply = await until(lambda: _ok(bus), timeout=20)
    assert reply["detail"]["failed_accepts"] > 0
    log = log_path.read_text()
    assert log.count("cannot accept connections") == 1 and "Traceback" not in log, log[-3000:]
    assert len(log) < 20_000, len(log)


async def _troubled(bus) -> dict[str, Any] | None:  # noqa: ANN001
    reply = await _health(bus)
    return reply if reply is not None and reply["detail"].get("accept_trouble") else None


async def _ok(bus) -> dict[str, Any] | None:  # noqa: ANN001
    reply = await _health(bus)
    return reply if reply is not None and reply["ok"] else None
