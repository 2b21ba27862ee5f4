"""A router out of file descriptors (probe of 2026-12-07). asyncio's accept loop reported each failed accept with
its traceback, 2048 a pass: 12-49 thousand log lines a second, a gigabyte in nine minutes, while its health said
ok; and its requests that needed a new connection to an engine failed as 502, the healthy engine marked suspect.
Now: one warning an episode, health not ok with the reason, the engine never blamed (503
`router_out_of_resources`), and new clients served again once descriptors free up. A real router (its limit
lowered with prlimit), a real engine, real sockets."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import time
from typing import Any

import httpx
import nats.errors

from libs.common.service import check_health
from tests.gpu_manager.harness import until
from tests.router.conftest import OpenAIStack
from tests.router.test_router import MODEL

HOGS = 40


async def _health(bus) -> dict[str, Any] | None:  # noqa: ANN001
    try:
        return (await check_health(bus, "router", timeout=3)).model_dump()
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return None


async def test_a_router_out_of_fds_says_so_once_blames_no_engine_and_serves_again(openai_stack: OpenAIStack,
                                                                                  bus) -> None:  # noqa: ANN001
    router = openai_stack.router
    pid, port = router.child.pid, int(router.url.rsplit(":", 1)[1])
    log_path = router.child.log_path
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:  # its connection open before the limit
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        assert (await c.post("/v1/completions", json=body)).status_code == 200  # a router that has served
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")), hard))  # none left
        hogs: list[socket.socket] = []
        try:
            for _ in range(HOGS):  # connected in the listen backlog; the router cannot accept them
                hogs.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            reply = await until(lambda: _troubled(bus), timeout=20)
            assert not reply["ok"] and "EMFILE" in reply["detail"]["accept_trouble"], reply
            r = await c.post("/v1/completions", json=body)  # a new connection to the engine: none to be had
            assert r.status_code == 503 and r.json()["error"]["code"] == "router_out_of_resources", r.text
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
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2, done.text
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
