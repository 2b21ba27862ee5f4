"""A request waiting for an engine that accepted its connection and never answers (a frozen or lost node: its kernel
still accepts, nothing reads) is resumed elsewhere as soon as that engine's endpoint is removed: it waited out the
whole read timeout (`token_timeout_s`, 30 s) after the removal and a successor serving (probe of 2026-12-07). A real
router, a real pattern engine, and a socket that accepts and stays silent; a replay waits there too (the batched
resume's shared request, resume_batch.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx

from libs.common.bus import Bus
from libs.common.store import Store
from tests.router.test_router import MODEL, announce, retire

TOKEN_TIMEOUT_S = 30.0


@contextlib.asynccontextmanager
async def silent_engine() -> AsyncIterator[tuple[str, list[asyncio.StreamWriter]]]:
    """A URL whose server accepts every connection and never reads, answers or closes; the connections held."""
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", held
    finally:
        for w in held:
            w.close()
        server.close()


async def wait_held(held: list[asyncio.StreamWriter], pending: asyncio.Task) -> None:
    deadline = time.monotonic() + 30
    while not held:  # the router's request is on the silent engine
        assert time.monotonic() < deadline and not pending.done(), "the request never reached the silent engine"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)


async def successor_then_removal(bus: Bus, store: Store, silent_id: str, successor: tuple[str, str],
                                 pending: asyncio.Task) -> tuple[httpx.Response, float]:
    """`successor` (id, url) announced, then the silent engine's endpoint removed: the request's answer, and how long
    after the removal it came."""
    await announce(bus, store, *successor)
    t0 = time.monotonic()
    await retire(bus, store, silent_id, "node_lost")
    r = await asyncio.wait_for(pending, TOKEN_TIMEOUT_S)
    return r, time.monotonic() - t0


async def test_a_request_to_a_silent_engine_resumes_on_its_successor_when_its_endpoint_is_removed(
        engines, start_router, bus: Bus, store: Store) -> None:  # noqa: ANN001
    b = engines("succ-b")
    async with silent_engine() as (url, held):
        await announce(bus, store, "silent-a", url)
        router = await asyncio.to_thread(start_router, token_timeout_s=TOKEN_TIMEOUT_S, engine_spare_connections=0)
        await asyncio.to_thread(b.wait_ready)
        async with httpx.AsyncClient(timeout=90) as c:
            pending = asyncio.create_task(c.post(router.url + "/v1/generate",
                                                 json={"model": MODEL, "prompt": "silent", "max_tokens": 4}))
            await wait_held(held, pending)
            r, took = await successor_then_removal(bus, store, "silent-a", ("succ-b", b.url), pending)
        assert r.status_code == 200, r.text
        assert r.json()["engines"] == ["silent-a", "succ-b"], r.json()
    assert took < TOKEN_TIMEOUT_S / 2, took  # resumed on the removal, not at the read timeout


async def test_a_replay_waiting_on_a_silent_successor_resumes_on_the_next_when_its_endpoint_is_removed(
        engines, start_router, bus: Bus, store: Store) -> None:  # noqa: ANN001
    # a replay goes through the batched resume (one shared request per engine): its wait for that request's answer
    # was not cut by the endpoint's removal and lasted the whole read timeout
    a, c = engines("first-a"), engines("succ-c")
    async with silent_engine() as (url, held):
        await asyncio.to_thread(a.wait_ready)
        await announce(bus, store, "first-a", a.url)
        router = await asyncio.to_thread(start_router, token_timeout_s=TOKEN_TIMEOUT_S, engine_spare_connections=0)
        await asyncio.to_thread(c.wait_ready)
        async with httpx.AsyncClient(timeout=90) as client:
            pending = asyncio.create_task(client.post(router.url + "/v1/generate",
                                                      json={"model": MODEL, "prompt": "silent", "max_tokens": 600}))
            await asyncio.sleep(1.0)  # streaming from first-a (5 ms a token)
            assert not pending.done()
            await announce(bus, store, "silent-s", url)
            await retire(bus, store, "first-a", "sigkill")
            await wait_held(held, pending)  # the replay is on the silent engine
            r, took = await successor_then_removal(bus, store, "silent-s", ("succ-c", c.url), pending)
        assert r.status_code == 200, r.text
        assert r.json()["engines"] == ["first-a", "silent-s", "succ-c"], r.json()
        assert router.stats()["resume_batches"]["batches"] >= 1
    assert took < TOKEN_TIMEOUT_S / 2, took
