"""`Reach`: whether an engine accepts TCP connections, asked off the router's event loop.

A connect to an engine times out on the router's loop: a loop held for seconds by its own work (a burst of a
thousand new requests) sees the timer expire before it reads the connect that the kernel finished in milliseconds,
and took that for the engine's failure, marking a healthy engine suspect (probe of 2026-12-07: most of the burst
answered 503 `no_endpoint`). Asked again here, the connect is a blocking one in a thread, bounded by the same
timeout counted by the kernel, not by the loop. Invariant: concurrent asks for one address share one check (a burst's
hundreds of timeouts cost one connect), and a check never blocks the loop.
"""

from __future__ import annotations

import asyncio
import socket

import httpx


class Reach:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._checks: dict[tuple[str, int], asyncio.Future[bool]] = {}
        self.checks = 0  # connects made (tests, /stats)

    async def accepts(self, url: str) -> bool:
        """Whether a TCP connect to `url`'s host and port succeeds within the timeout."""
        u = httpx.URL(url)
        address = (u.host, u.port or (443 if u.scheme == "https" else 80))
        check = self._checks.get(address)
        if check is None:
            self.checks += 1
            check = asyncio.ensure_future(asyncio.to_thread(_connects, address, self.timeout_s))
            self._checks[address] = check
            check.add_done_callback(lambda _: self._checks.pop(address, None))
        return await asyncio.shield(check)


def _connects(address: tuple[str, int], timeout_s: float) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False
