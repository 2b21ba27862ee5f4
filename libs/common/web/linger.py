"""Lingering close for the connections of an API behind the guard (the admin API, the router) (what nginx's `lingering_close` does), so that a client still
sending a refused body reads its 401 or 413 instead of a reset.

Why: the guard (guard.py) answers a request without a token, or with a body over the limit, from its headers, and
the answer says `Connection: close`. Closing a socket with bytes unread makes the kernel send a reset, and the
reset makes the client's kernel drop the answer it had received but not yet read: a client that sends its whole
body before reading (most do) saw only `ConnectionResetError` / `BrokenPipeError` (issue 18: 0 status lines for
8 MiB bodies in the chaos runs).

How: uvicorn's h11 protocol with its transport wrapped. Where uvicorn closes the connection, the wrapper instead
sends what is buffered and a FIN (`write_eof`: the answer is complete and readable), then keeps reading and drops
what arrives, without parsing or keeping it, until the client closes its side, `max_bytes` have been dropped, or
`max_s` have passed; then it closes. So the decision is still made before any byte of a body is read, and the
answer leaves at once (a client that reads while it sends stops early); only the discarding reads what the
client insists on sending, bounded, on the API's own loop (the controller's API runs on one of its own, never
the incident pipeline's).

Invariants: a connection lingers at most once and at most `max_s`; what it drops is never buffered (no memory
grows with the body); a transport that cannot half-close is closed at once, as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("holdfast.web")


class LingerStats:
    """Counters over all connections (the API's health detail, tests)."""

    def __init__(self) -> None:
        self.lingered = 0  # connections closed through a linger
        self.dropped_bytes = 0  # bytes read and dropped while lingering
        self.cut = 0  # lingers ended by a bound (bytes or time) with the client still sending: a reset may follow


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close` lingers; everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, max_bytes: int, max_s: float, stats: LingerStats) -> None:
        self._t = transport
        self._max_bytes = max_bytes
        self._max_s = max_s
        self._stats = stats
        self.lingering = False
        self._dropped = 0
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def is_closing(self) -> bool:
        return self.lingering or self._t.is_closing()

    def close(self) -> None:
        if self.lingering or self._t.is_closing():
            return
        if self._max_s <= 0 or not self._t.can_write_eof():
            self._t.close()
            return
        self.lingering = True
        self._stats.lingered += 1
        try:
            self._t.write_eof()  # the answer, then a FIN: complete and readable by the client
            self._t.resume_reading()  # uvicorn's flow control may have paused it while the body was unread
        except (OSError, RuntimeError):
            self._t.close()
            return
        self._timer = asyncio.get_running_loop().call_later(self._max_s, self._cut)

    def drop(self, n: int) -> None:
        """`n` bytes arrived while lingering: dropped; past `max_bytes`, the connection is closed."""
        self._dropped += n
        self._stats.dropped_bytes += n
        if self._dropped > self._max_bytes:
            self._cut()

    def finish(self) -> None:
        """The client closed its side (or the connection is gone): close now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._t.is_closing():
            self._t.close()

    def _cut(self) -> None:
        if not self._t.is_closing():
            self._stats.cut += 1
            log.info("a refused request's client still sending after %d bytes dropped: closed", self._dropped)
        self.finish()


def lingering_h11(max_bytes: int, max_s: float, stats: LingerStats) -> type[H11Protocol]:
    """uvicorn's h11 protocol (Config `http=`) whose connections close by lingering."""

    class LingeringH11(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(_LingeringTransport(transport, max_bytes, max_s, stats))  # type: ignore[arg-type]

        def data_received(self, data: bytes) -> None:
            t = self.transport
            if isinstance(t, _LingeringTransport) and t.lingering:
                t.drop(len(data))  # never parsed, never kept
                return
            super().data_received(data)

        def eof_received(self) -> bool | None:  # type: ignore[override]
            t = self.transport
            if isinstance(t, _LingeringTransport) and t.lingering:
                t.finish()
                return None
            return super().eof_received()  # type: ignore[func-returns-value]

        def connection_lost(self, exc: Exception | None) -> None:
            t = self.transport
            if isinstance(t, _LingeringTransport):
                t.finish()
            super().connection_lost(exc)

    return LingeringH11
