"""A request waiting for an engine that accepted its connection and never answers (a frozen or lost node: its kernel
still accepts, nothing reads) is resumed elsewhere as soon as that engine's endpoint is removed: it waited out the
whole read timeout (`token_timeout_s`, 30 s) after the removal and a successor serving (probe of 2026-12-07). A real
router, a real pattern engine, and a socket that accepts and stays silent."""

from __future__ import annotations

import asyncio
import time

import httpx

from libs.common.bus import Bus
from libs.common.store import Store
from tests.router.test_router import MODEL, announce, retire

TOKEN_TIMEOUT_S = 30.0


async def test_a_request_to_a_silent_engine_resumes_on_its_successor_when_its_endpoint_is_removed(
        engines, start_router, bus: Bus, store: Store) -> None:  # noqa: ANN001
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # reads nothing, answers nothing, closes nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    b = engines("succ-b")
    try:
        await announce(bus, store, "silent-a", url)
        router = await asyncio.to_thread(start_router, token_timeout_s=TOKEN_TIMEOUT_S, engine_spare_connections=0)
        await asyncio.to_thread(b.wait_ready)
        async with httpx.AsyncClient(timeout=90) as c:
            pending = asyncio.create_task(c.post(router.url + "/v1/generate",
                                                 json={"model": MODEL, "prompt": "silent", "max_tokens": 4}))
            deadline = time.monotonic() + 30
            while not held:  # the router's request is on the silent engine
                assert time.monotonic() < deadline and not pending.done(), "the request never reached the engine"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            await announce(bus, store, "succ-b", b.url)
            t0 = time.monotonic()
            await retire(bus, store, "silent-a", "node_lost")
            r = await asyncio.wait_for(pending, TOKEN_TIMEOUT_S)
            took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["engines"] == ["silent-a", "succ-b"], r.json()
        assert took < TOKEN_TIMEOUT_S / 2, took  # resumed on the removal, not at the read timeout
    finally:
        for w in held:
            w.close()
        server.close()
