"""The router's spare connections (services/router/spare.py) against a real loopback server and httpx's pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpcore
import httpx
import pytest

from services.router.spare import SpareBackend


class Server:
    """A minimal HTTP/1.1 server: counts accepted connections; answers each request `200 ok`, keeping it open."""

    def __init__(self) -> None:
        self.accepted = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.base_events.Server | None = None
        self.url = ""

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head:
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()


@pytest.fixture
async def srv() -> AsyncIterator[Server]:
    server = Server()
    server.url = await server.start()
    yield server
    await server.stop()


@contextlib.asynccontextmanager
async def pooled(spares: SpareBackend) -> AsyncIterator[httpx.AsyncClient]:
    """A client whose pool connects through `spares` (as the router's, app.py); both closed after."""
    transport = httpx.AsyncHTTPTransport()
    transport._pool = httpcore.AsyncConnectionPool(max_connections=None, network_backend=spares)
    client = httpx.AsyncClient(transport=transport, timeout=30.0)  # a loaded CI machine can stall a loop for seconds
    try:
        yield client
    finally:
        await client.aclose()
        await spares.close()


async def filled(spares: SpareBackend, url: str, n: int, *, top_up: bool = True) -> None:
    if top_up:
        spares.top_up(url)
    for _ in range(200):
        if spares.stats()["open"] >= n and not spares._filling:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not filled: {spares.stats()}")


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in 2 s")


async def test_requests_take_spares_and_the_pool_never_connects_itself(srv: Server) -> None:
    url = srv.url
    spares = SpareBackend(4)
    async with pooled(spares) as client:
        await filled(spares, url, 4)
        assert srv.accepted == 4  # opened ahead, no request on them
        answers = await asyncio.gather(*(client.get(url + "/x") for _ in range(3)))
        assert [a.text for a in answers] == ["ok"] * 3
        st = spares.stats()
        assert st["taken"] == 3 and st["missed"] == 0
        await filled(spares, url, 4, top_up=False)  # taking them topped the engine up again
        assert srv.accepted == 7
        # more taken at once than are spare, some while the top-up connects: it connects again till 4 are open
        answers = await asyncio.gather(*(client.get(url + "/y") for _ in range(10)))
        assert all(a.text == "ok" for a in answers)
        await filled(spares, url, 4, top_up=False)


async def test_a_spare_the_server_closed_or_aged_is_never_handed_out(srv: Server) -> None:
    url = srv.url
    now = [0.0]
    spares = SpareBackend(2, max_age_s=10.0, clock=lambda: now[0])
    async with pooled(spares) as client:
        await filled(spares, url, 2)
        for w in srv.writers:  # the engine closes its idle connections
            w.close()
        await asyncio.sleep(0.05)
        assert (await client.get(url + "/x")).text == "ok"
        st = spares.stats()
        assert st["dropped"] == 2 and st["taken"] == 0 and st["missed"] == 1
        await filled(spares, url, 2)
        now[0] = 11.0  # older than max_age_s
        assert (await client.get(url + "/y")).text == "ok"
        assert spares.stats()["taken"] == 0


async def test_prune_closes_spares_of_engines_gone_and_zero_turns_it_off(srv: Server) -> None:
    url = srv.url
    spares = SpareBackend(3)
    await filled(spares, url, 3)
    await spares.prune([])  # the engine left the table
    assert spares.stats()["open"] == 0 and spares.stats()["dropped"] == 3
    await spares.close()
    off = SpareBackend(0)
    async with pooled(off) as client:
        off.top_up(url)
        assert not off._filling
        before = srv.accepted
        assert (await client.get(url + "/z")).text == "ok"
        assert srv.accepted == before + 1 and off.stats()["missed"] == 0


async def test_an_engine_that_refuses_connections_counts_failures_and_requests_fail_plainly(srv: Server) -> None:
    url = srv.url
    await srv.stop()  # nothing listens there now
    spares = SpareBackend(2, connect_timeout_s=1.0)
    async with pooled(spares) as client:
        spares.top_up(url)
        await until(lambda: not spares._filling)
        assert spares.stats()["failed"] == 2 and spares.stats()["open"] == 0
        with pytest.raises(httpx.ConnectError):
            await client.get(url + "/x")


async def test_the_keeper_tops_an_engine_up_only_once_it_settled_and_closes_a_gone_ones_spares(srv: Server) -> None:
    url = srv.url
    now = [0.0]
    urls = [url]
    spares = SpareBackend(3, clock=lambda: now[0])
    keeper = asyncio.create_task(spares.keep(lambda: urls, period_s=0.01, settle_s=2.0))
    try:
        await asyncio.sleep(0.1)
        assert srv.accepted == 0  # a new engine's first seconds are its recovery: nothing opened to it
        now[0] = 2.5
        await filled(spares, url, 3, top_up=False)
        assert srv.accepted == 3
        urls.clear()  # the engine left the table
        # a prune empties the deque first, then closes each (awaiting): "open" reads 0 before the last is closed
        await until(lambda: spares.stats()["dropped"] == 3)
        assert spares.stats()["open"] == 0
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        await spares.close()


class Gated(httpcore.AnyIOBackend):
    """Connects once `gate` is set: a top-up held mid-connect."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def connect_tcp(self, *args: Any, **kw: Any) -> httpcore.AsyncNetworkStream:
        await self.gate.wait()
        return await super().connect_tcp(*args, **kw)


async def test_a_prune_while_a_top_up_connects_keeps_its_connections(srv: Server) -> None:
    """Found by CI: a prune that replaced an engine's deque while a top-up connected lost the top-up's connections
    (open, never closed) and the next pass opened as many again."""
    url = srv.url
    inner = Gated()
    spares = SpareBackend(3, inner=inner)
    try:
        spares.top_up(url)
        await asyncio.sleep(0.01)
        await spares.prune([url])  # the top-up is connecting
        inner.gate.set()
        await filled(spares, url, 3, top_up=False)
        spares.top_up(url)
        await spares.prune([url])
        await asyncio.sleep(0.05)
        assert spares.stats()["opened"] == 3 and spares.stats()["open"] == 3 and srv.accepted == 3
    finally:
        await spares.close()
    assert spares.stats()["open"] == 0 and spares.stats()["dropped"] == 3


async def test_a_take_or_a_miss_refills_only_after_the_burst_and_not_an_engine_gone_meanwhile(srv: Server) -> None:
    """Invariant 4: the connections a burst took are made up `refill_after_s` later, not in the burst's own loop
    passes; an engine that left the keeper's list meanwhile gets none."""
    url = srv.url
    urls = [url]
    spares = SpareBackend(3, refill_after_s=0.3)
    keeper = asyncio.create_task(spares.keep(lambda: urls, period_s=60.0))
    async with pooled(spares) as client:
        await filled(spares, url, 3)
        accepted = srv.accepted
        answers = await asyncio.gather(*(client.get(url + "/x") for _ in range(5)))  # 3 taken, 2 missed
        assert [a.text for a in answers] == ["ok"] * 5
        assert srv.accepted == accepted + 2  # the misses' own connects; no refill yet
        await asyncio.sleep(0.1)
        assert srv.accepted == accepted + 2 and spares.stats()["open"] == 0
        await filled(spares, url, 3, top_up=False)  # made up once the burst is past
        urls.clear()  # the engine left the table: what its next take starts connects nothing
        host, port = url.removeprefix("http://").split(":")
        taken = spares.stats()["taken"]
        stream = await spares.connect_tcp(host, int(port))  # as the pool connects: a spare taken
        await stream.aclose()
        assert spares.stats()["taken"] == taken + 1
        before = srv.accepted
        await asyncio.sleep(0.5)
        assert srv.accepted == before and spares.stats()["open"] == 2 and spares.stats()["failed"] == 0
    keeper.cancel()
    await asyncio.gather(keeper, return_exceptions=True)
