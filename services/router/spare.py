"""Connections to each engine opened ahead of need, so that a new request does not connect on its way.

Measured (H200, 8b, 64 streams running, 16 new requests sent at once): a new request's way from the router to
the engine and back took 104-112 ms of its 200-235 ms to first token. httpx had to open a connection for each
(the running streams held all the idle ones), and opening one through anyio takes a task group and several
passes of the router's event loop, each pass long while the loop relays 64 streams (on the CPU machine: 10 ms
to begin the connect, 35 ms connecting).

`SpareBackend` is httpcore's network backend for the router's pool: it keeps up to `spare` TCP connections
open to each engine (no request sent on them: an engine spends nothing on one but its accept) and hands one
out when the pool connects, so the pool's connect returns at once. It tops an engine up in the background
when one is taken, when an endpoint is added or promised (a successor's first requests come at once), and
every `period_s`. (Sending cheap requests to open them instead was tried on the CPU machine: the pings took
the engine's interpreter from its step thread and doubled the largest gap around a kill.)

Invariants:
1. A request never waits for a top-up: top-ups are background tasks; their failures are counted, not raised.
2. A spare connection handed out is open: one older than `max_age_s` (engines close idle connections after
   30 s) or readable (the engine closed it, or sent something unasked) is closed instead, never handed out.
3. At most one top-up runs per engine address; `spare` 0 turns it all off (every connect is the inner backend's).
4. A top-up a take or a miss starts connects only `refill_after_s` later: requests come in bursts (a failover's
   resumed streams and the requests sent during the outage, all at once on the successor), and connecting in the
   burst's own loop passes delayed the very requests the spares were for. `top_up` (the keeper's, a standby's
   announcement) connects at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import httpcore

log = logging.getLogger("holdfast.router.spare")

Address = tuple[str, int]


def address(url: str) -> Address | None:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:  # TLS connections are the pool's own (no spares)
        return None
    return parts.hostname, parts.port or 80


def addresses(urls: Iterable[str]) -> set[Address]:
    """The engine addresses of `urls` that can have spares (plain http)."""
    return {a for u in urls if (a := address(u)) is not None}


class SpareBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, spare: int, *, max_age_s: float = 20.0, connect_timeout_s: float = 2.0,
                 inner: httpcore.AsyncNetworkBackend | None = None, clock: Callable[[], float] = time.monotonic,
                 refill_after_s: float = 0.5) -> None:
        self.spare, self.max_age_s, self.connect_timeout_s = spare, max_age_s, connect_timeout_s
        self.refill_after_s = refill_after_s  # invariant 4
        self._urls: Callable[[], Iterable[str]] | None = None  # the engines `keep` keeps spares to
        self.inner = inner or httpcore.AnyIOBackend()
        self.clock = clock
        self._stash: dict[Address, collections.deque[tuple[float, httpcore.AsyncNetworkStream]]] = {}
        self._filling: dict[Address, asyncio.Task[None]] = {}
        self.taken = self.missed = self.opened = self.failed = self.dropped = 0

    # ------------------------------------------------------------ httpcore's backend interface

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        if self.spare > 0 and local_address is None and not socket_options:
            stream = await self._take((host, port))
            if stream is not None:
                return stream
            self.missed += 1
            self._top_up((host, port), later=True)
        return await self.inner.connect_tcp(host, port, timeout=timeout, local_address=local_address,
                                            socket_options=socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        return await self.inner.connect_unix_socket(path, timeout=timeout, socket_options=socket_options)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)

    # ------------------------------------------------------------ spares

    async def _take(self, addr: Address) -> httpcore.AsyncNetworkStream | None:
        stash = self._stash.get(addr)
        now = self.clock()
        while stash:
            opened, stream = stash.popleft()
            if now - opened <= self.max_age_s and not stream.get_extra_info("is_readable"):  # invariant 2
                self.taken += 1
                self._top_up(addr, later=True)
                return stream
            await self._drop(stream)
        return None

    async def _drop(self, stream: httpcore.AsyncNetworkStream) -> None:
        self.dropped += 1
        try:
            await stream.aclose()
        except OSError:
            pass

    def top_up(self, url: str) -> None:
        """Open this engine's spares up to `spare` in the background (nothing when enough are open)."""
        addr = address(url)
        if addr is not None:
            self._top_up(addr)

    def _top_up(self, addr: Address, *, later: bool = False) -> None:
        if self.spare <= 0 or addr in self._filling or len(self._stash.get(addr, ())) >= self.spare:
            return
        self._filling[addr] = asyncio.create_task(self._fill(addr, self.refill_after_s if later else 0.0),
                                                  name=f"spare-connections {addr[0]}:{addr[1]}")

    async def _fill(self, addr: Address, after_s: float = 0.0) -> None:
        # rounds until `spare` are open: connections taken while a round connects are made up by the next
        try:
            if after_s > 0:
                await asyncio.sleep(after_s)  # invariant 4
                if self._urls is not None and addr not in addresses(self._urls()):
                    return  # gone meanwhile (an engine that died as its last requests took or missed)
            while (need := self.spare - len(self._stash.setdefault(addr, collections.deque()))) > 0:
                got = await asyncio.gather(*(self.inner.connect_tcp(*addr, timeout=self.connect_timeout_s)
                                             for _ in range(need)), return_exceptions=True)
                now = self.clock()
                ok = [g for g in got if not isinstance(g, BaseException)]
                self.opened += len(ok)
                self.failed += len(got) - len(ok)
                self._stash.setdefault(addr, collections.deque()).extend((now, g) for g in ok)
                if len(ok) < len(got):  # the engine refuses or is gone: the next take or pass tries again
                    log.debug("spare connections to %s:%d: %d of %d opened", *addr, len(ok), len(got))
                    return
        finally:
            self._filling.pop(addr, None)

    async def prune(self, keep: Iterable[str]) -> None:
        """Close spares that aged out or were closed, and every spare of an engine not in `keep` (urls). Each
        engine's deque is emptied and refilled in place, never replaced: a top-up connecting meanwhile appends to
        the same one (replacing it lost that top-up's connections, open and never closed, and opened as many again)."""
        wanted = addresses(keep)
        now = self.clock()
        for addr in list(self._stash):
            stash = self._stash[addr]
            entries = list(stash)
            stash.clear()
            for opened, stream in entries:
                if addr in wanted and now - opened <= self.max_age_s and not stream.get_extra_info("is_readable"):
                    stash.append((opened, stream))
                else:
                    await self._drop(stream)  # a take or a top-up may run meanwhile: on the same deque
            if not stash and addr not in self._filling:
                del self._stash[addr]

    async def keep(self, urls: Callable[[], Iterable[str]], period_s: float, settle_s: float = 2.0) -> None:
        """Now and then: spares of engines gone or aged closed, every engine topped up that has been in the
        table `settle_s` (a successor's first seconds are its recovery: connecting to it then took the
        router's loop and the successor's interpreter from the resumed streams)."""
        if self.spare <= 0:
            return
        self._urls = urls
        seen: dict[str, float] = {}
        while True:
            now_urls = list(urls())
            now = self.clock()
            seen = {u: seen.get(u, now) for u in now_urls}
            await self.prune(now_urls)
            for url, since in seen.items():
                if now - since >= settle_s:
                    self.top_up(url)
            await asyncio.sleep(period_s)

    def stats(self) -> dict[str, int]:
        return {"spare": self.spare, "open": sum(len(s) for s in self._stash.values()), "taken": self.taken,
                "missed": self.missed, "opened": self.opened, "failed": self.failed, "dropped": self.dropped}

    async def close(self) -> None:
        tasks = list(self._filling.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stash in self._stash.values():
            for _, stream in stash:
                await self._drop(stream)
        self._stash.clear()
