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

The same protocol also bounds how long a request's headers may take (`header_timeout_s`, what nginx's
`client_header_timeout` does): from a connection's start, or from the first byte of the next request on a kept-alive
one, its headers must be complete within that time, or the connection is closed. uvicorn has no such bound: a
client sending a header line now and then ("slowloris"), or nothing at all, held its connection, an fd and memory
forever, and enough of them took every fd of the process (tests/router/test_api_keys.py: 3,000 such connections
still open after 40 s before this).

And how long its body may take (`body_timeout_s`): from the moment a request's headers are complete, its body must
be complete within that time. A client that sent whole headers and then its body a byte a second held the
connection, and the request's task waiting in the app's `receive`, for as long as it liked. Past the bound, a request
not yet answered gets a 408 in the API's error shape (`refusal`, the guard's `refusal_response`) with
`Connection: close` and the app sees a disconnect; one already answered (or answering) is closed. The connection
then closes by lingering, as for any refusal. The bound is a total, not a rate: a deadline between reads (nginx's
`client_body_timeout`) does not stop one byte a second. It holds from the headers whatever the app does, which is
fair because both APIs read a body as soon as its request starts (FastAPI, the guard's count); it implies a
rate (`max_body_bytes / body_timeout_s`: 16 MiB in 30 s is 0.56 MB/s for the router's largest body), which a
deployment with slow clients and large bodies raises with the bound.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from libs.common.web.guard import Refusal, admin_refusal, refusal_response

log = logging.getLogger("holdfast.web")


class LingerStats:
    """Counters over all connections (the API's health detail, tests)."""

    def __init__(self) -> None:
        self.lingered = 0  # connections closed through a linger
        self.dropped_bytes = 0  # bytes read and dropped while lingering
        self.cut = 0  # lingers ended by a bound (bytes or time) with the client still sending: a reset may follow
        self.slow_headers = 0  # connections closed because a request's headers took over `header_timeout_s`
        self.slow_bodies = 0  # requests refused (408) or cut because a body took over `body_timeout_s`


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


def lingering_h11(max_bytes: int, max_s: float, stats: LingerStats, header_timeout_s: float = 10.0,
                  body_timeout_s: float = 30.0, refusal: Refusal = admin_refusal) -> type[H11Protocol]:
    """uvicorn's h11 protocol (Config `http=`) whose connections close by lingering, whose requests' headers must be
    complete within `header_timeout_s` and bodies within `body_timeout_s` of their headers (0: no bound); a late
    body's 408 carries `refusal`'s error body."""

    class LingeringH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _body_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(_LingeringTransport(transport, max_bytes, max_s, stats))  # type: ignore[arg-type]
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            t = self.transport
            if isinstance(t, _LingeringTransport) and t.lingering:
                t.drop(len(data))  # never parsed, never kept
                return
            self._arm_header_timer()  # the next request's first bytes on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm_header_timer()  # its headers are in

        def handle_events(self) -> None:
            super().handle_events()
            # Called on new bytes and when a response completes (a pipelined request's turn): the body's clock runs
            # while the request being read has its headers and not yet its whole body.
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                if body_timeout_s > 0 and self._body_timer is None:
                    self._body_timer = asyncio.get_running_loop().call_later(body_timeout_s, self._body_late)
            else:
                self._disarm_body_timer()

        def eof_received(self) -> bool | None:  # type: ignore[override]
            t = self.transport
            if isinstance(t, _LingeringTransport) and t.lingering:
                t.finish()
                return None
            return super().eof_received()  # type: ignore[func-returns-value]

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            self._disarm_body_timer()
            t = self.transport
            if isinstance(t, _LingeringTransport):
                t.finish()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if header_timeout_s > 0 and self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._header_timer = asyncio.get_running_loop().call_later(header_timeout_s, self._headers_late)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            idle = self.cycle is None or self.cycle.response_complete  # no request of this connection running
            if self.conn.their_state is h11.IDLE and idle and not self.transport.is_closing():
                stats.slow_headers += 1
                self.transport.close()  # nothing was asked (no headers yet): nothing to answer

        def _disarm_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_late(self) -> None:
            self._body_timer = None
            if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
                return
            stats.slow_bodies += 1
            cycle = self.cycle
            answered = cycle is not None and cycle.response_started
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app's `receive` says so now; what it still sends is dropped
                cycle.message_event.set()
            if cycle is not None and not answered and self.conn.our_state is h11.SEND_RESPONSE:
                headers, body = refusal_response(408, "request_timeout", "the request body was not complete "
                                                 f"within {body_timeout_s:g} s", refusal)
                cycle.response_started = cycle.response_complete = True
                for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            log.debug("a request's body not complete %g s after its headers: %s", body_timeout_s,
                     "closed" if answered else "answered 408, closed")
            self.transport.close()  # lingers: the 408 is read, what the client still trickles is dropped

    return LingeringH11
