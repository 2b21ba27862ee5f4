"""Lingering close for the connections of an API behind the guard (the admin API, the router, the batched engine's
front) (what nginx's `lingering_close` does), so that a client still sending a refused body reads its 401 or 413
instead of a reset.

Why: the guard (guard.py) answers a request without a token, or with a body over the limit, from its headers, and
the answer says `Connection: close`. Closing a socket with bytes unread makes the kernel send a reset, and the
reset makes the client's kernel drop the answer it had received but not yet read: a client that sends its whole
body before reading (most do) saw only `ConnectionResetError` / `BrokenPipeError` (issue 18: 0 status lines for
8 MiB bodies in the chaos runs).

How: uvicorn's protocol (h11: `lingering_h11`; httptools: `lingering_httptools`) with its transport wrapped. Where uvicorn closes the connection, the wrapper instead
sends what is buffered and a FIN (`write_eof`: the answer is complete and readable), then keeps reading and drops
what arrives, without parsing or keeping it, until the client closes its side, `max_bytes` have been dropped, or
`max_s` have passed; then it closes. So the decision is still made before any byte of a body is read, and the
answer leaves at once (a client that reads while it sends stops early); only the discarding reads what the
client insists on sending, bounded, on the API's own loop (the controller's API runs on one of its own, never
the incident pipeline's).

Invariants: a connection lingers at most once and at most `max_s`; what it drops is never buffered (no memory
grows with the body); a transport that cannot half-close is closed at once, as before; once the server stops, no
connection lingers (its graceful shutdown waited for every linger: up to `max_s`, 10 s for the admin API, past
the 5 s a supervisor gives a service to stop).

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
deployment with slow clients and large bodies raises with the bound. The 408 is told to the guard in front of the app
(guard.py `tell_refused`): it counts it and hands it to its `on_refused` (the admin API's audit record), as its own.

And how long an answer may wait for its client to read (`send_timeout_s`, nginx's `send_timeout`): once the
connection's write buffer is full (the transport paused writing: the client is not reading), it must drain within
that time, or the connection is aborted (the app's `send` then sees a disconnect). A client that pipelined requests
and never read their answers held each its connection, an fd and the answer's memory forever, past every other bound
(the admin API: 300 such connections without a token, the public `/openapi.json` asked 200 times each, and every
other client's request timed out for as long as they stayed). Only a stall counts: a slow reader resumes the clock
each time its buffer drains.

And, on the httptools protocol, how long a request's head may be (`MAX_HEAD_BYTES`, 64 KiB; h11 bounds its own at
16 KiB): past it, 431 before the parser sees more (httptools parsed a head of any size: a 64 MB header held the
batched engine's front 5-6 s, every stream beside it paused).

Bytes that are not HTTP (the parser's error) get a 400 in the API's error shape too (`send_400_response`), not
uvicorn's plain text, which an OpenAI client, say, cannot read.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from libs.common.web.guard import Refusal, admin_refusal, refusal_response, tell_refused

log = logging.getLogger("holdfast.web")

# A request's head (request line and headers) at most this long on the httptools protocol: nginx's default
# buffers for one (`large_client_header_buffers` 4 x 8k) and twice h11's bound in uvicorn (16 KiB)
MAX_HEAD_BYTES = 64 << 10

# nginx's `send_timeout` is 60 s; an answer nobody reads for 30 s is nobody's (a streaming client reading at all
# resumes the clock whenever its buffer drains)
SEND_TIMEOUT_S = 30.0


class LingerStats:
    """Counters over all connections (the API's health detail, tests)."""

    def __init__(self) -> None:
        self.lingered = 0  # connections closed through a linger
        self.dropped_bytes = 0  # bytes read and dropped while lingering
        self.cut = 0  # lingers ended by a bound (bytes or time) with the client still sending: a reset may follow
        self.slow_headers = 0  # connections closed because a request's headers took over `header_timeout_s`
        self.slow_bodies = 0  # requests refused (408) or cut because a body took over `body_timeout_s`
        self.slow_readers = 0  # connections aborted because their answers went unread for `send_timeout_s`


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

    def stop_lingering(self) -> None:
        """The server stops: a linger under way ends now and `close` closes at once from here on (the answer was
        sent; a linger would hold the server's graceful shutdown for up to `max_s`)."""
        self._max_s = 0
        if self.lingering:
            self.finish()

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


class _Bounded:
    """What both protocols below add to uvicorn's (a mixin before it in the bases): connections that close by
    lingering, a bound on a request's headers and one on its body, refusals in the API's error shape. Each protocol
    says where its parser is (`_awaiting_headers`, `_awaiting_body`) and how a refusal is written (`_write`); the
    factory sets the class's settings."""

    max_bytes: int
    max_s: float
    stats: LingerStats
    header_timeout_s: float
    body_timeout_s: float
    send_timeout_s: float
    refusal: Refusal
    transport: Any
    cycle: Any
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None

    def _awaiting_headers(self) -> bool:
        """No request of the connection has all its headers yet (between requests, or amid one's headers)."""
        raise NotImplementedError

    def _awaiting_body(self) -> bool:
        """A request has its headers and not yet its whole body."""
        raise NotImplementedError

    def _write(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole response, through the protocol's own framing (the connection closes after it)."""
        raise NotImplementedError

    def _lingering(self) -> bool:
        t = self.transport
        return isinstance(t, _LingeringTransport) and t.lingering

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        wrapped = _LingeringTransport(transport, self.max_bytes, self.max_s, self.stats)  # type: ignore[arg-type]
        super().connection_made(wrapped)  # type: ignore[misc]
        self._arm_header_timer()

    def shutdown(self) -> None:
        """The server stops (uvicorn calls this on every connection): an idle connection closes, and a lingering
        one ends, at once; a request under way still finishes, its connection closed after it (uvicorn's)."""
        if isinstance(self.transport, _LingeringTransport):
            self.transport.stop_lingering()
        super().shutdown()  # type: ignore[misc]

    def eof_received(self) -> None:
        if self._lingering():
            self.transport.finish()
            return
        super().eof_received()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm("_header_timer")
        self._disarm("_body_timer")
        self._disarm("_send_timer")
        if isinstance(self.transport, _LingeringTransport):
            self.transport.finish()
        super().connection_lost(exc)  # type: ignore[misc]

    def pause_writing(self) -> None:
        """The write buffer is full (the client does not read): it must drain within `send_timeout_s`."""
        super().pause_writing()  # type: ignore[misc]
        if self.send_timeout_s > 0 and self._send_timer is None:
            self._send_timer = asyncio.get_running_loop().call_later(self.send_timeout_s, self._send_late)

    def resume_writing(self) -> None:
        self._disarm("_send_timer")
        super().resume_writing()  # type: ignore[misc]

    def _send_late(self) -> None:
        self._send_timer = None
        self.stats.slow_readers += 1
        log.info("a client read nothing of its answers for %g s: its connection aborted", self.send_timeout_s)
        t = self.transport
        (t._t if isinstance(t, _LingeringTransport) else t).abort()  # a close would wait for the buffer to drain

    def _after_data(self) -> None:
        """Bytes were parsed: a request whose headers are in stops its header clock; one whose body is still to come
        starts its body clock (once)."""
        if not self._awaiting_headers():
            self._disarm("_header_timer")
        if self._awaiting_body() and not self.transport.is_closing():
            if self.body_timeout_s > 0 and self._body_timer is None:
                self._body_timer = asyncio.get_running_loop().call_later(self.body_timeout_s, self._body_late)
        else:
            self._disarm("_body_timer")

    def _disarm(self, timer: str) -> None:
        """Cancel the timer held in attribute `timer` (`_header_timer`, `_body_timer`, `_send_timer`), if armed."""
        handle = getattr(self, timer)
        if handle is not None:
            handle.cancel()
            setattr(self, timer, None)

    def _arm_header_timer(self) -> None:
        if self.header_timeout_s > 0 and self._header_timer is None and self._awaiting_headers():
            self._header_timer = asyncio.get_running_loop().call_later(self.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        idle = self.cycle is None or self.cycle.response_complete  # no request of this connection running
        if self._awaiting_headers() and idle and not self.transport.is_closing():
            self.stats.slow_headers += 1
            self.transport.close()  # nothing was asked (no headers yet): nothing to answer

    def _body_late(self) -> None:
        self._body_timer = None
        if not self._awaiting_body() or self.transport.is_closing():
            return
        self.stats.slow_bodies += 1
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's `receive` says so now; what it still sends is dropped
            cycle.message_event.set()
        if cycle is not None and not answered:
            headers, body = refusal_response(408, "request_timeout", "the request body was not complete "
                                             f"within {self.body_timeout_s:g} s", self.refusal)
            cycle.response_started = cycle.response_complete = True
            self._write(408, headers, body)
            tell_refused(cycle.scope, 408)  # the guard's count, and its `on_refused` (the admin API's audit)
        log.debug("a request's body not complete %g s after its headers: %s", self.body_timeout_s,
                  "closed" if answered else "answered 408, closed")
        self.transport.close()  # lingers: the 408 is read, what the client still trickles is dropped

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP (its parser's error), in the API's error shape instead of
        its plain text."""
        headers, body = refusal_response(400, "bad_request", msg, self.refusal)
        self._write(400, headers, body)
        self.transport.close()


def _settings(max_bytes: int, max_s: float, stats: LingerStats, header_timeout_s: float, body_timeout_s: float,
              refusal: Refusal, send_timeout_s: float) -> dict[str, Any]:
    return {"max_bytes": max_bytes, "max_s": max_s, "stats": stats, "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s, "refusal": staticmethod(refusal), "send_timeout_s": send_timeout_s}


def lingering_h11(max_bytes: int, max_s: float, stats: LingerStats, header_timeout_s: float = 10.0,
                  body_timeout_s: float = 30.0, refusal: Refusal = admin_refusal,
                  send_timeout_s: float = SEND_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol (Config `http=`) whose connections close by lingering, whose requests' headers must be
    complete within `header_timeout_s`, bodies within `body_timeout_s` of their headers, and whose unread answers
    drain within `send_timeout_s` (0: no bound); a late body's 408 and a malformed request's 400 carry `refusal`'s
    error body."""

    class LingeringH11(_Bounded, H11Protocol):
        def data_received(self, data: bytes) -> None:
            if self._lingering():
                self.transport.drop(len(data))  # never parsed, never kept
                return
            self._arm_header_timer()  # the next request's first bytes on a kept-alive connection
            super().data_received(data)
            self._after_data()

        def handle_events(self) -> None:
            super().handle_events()
            # Also called when a response completes (a pipelined request's turn): its body's clock may start now.
            self._after_data()

        def _awaiting_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE

        def _awaiting_body(self) -> bool:
            return self.conn.their_state is h11.SEND_BODY

        def _write(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
            try:
                for event in (h11.Response(status_code=status, headers=headers,
                                           reason=HTTPStatus(status).phrase.encode()),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # a response of this connection was under way: nothing can be added
                pass

    for name, value in _settings(max_bytes, max_s, stats, header_timeout_s, body_timeout_s, refusal,
                                 send_timeout_s).items():
        setattr(LingeringH11, name, value)
    return LingeringH11


def lingering_httptools(max_bytes: int, max_s: float, stats: LingerStats, header_timeout_s: float = 10.0,
                        body_timeout_s: float = 30.0, refusal: Refusal = admin_refusal,
                        send_timeout_s: float = SEND_TIMEOUT_S) -> type[HttpToolsProtocol]:
    """The same over uvicorn's httptools protocol, whose per-write cost is a fraction of h11's (the batched engine's
    front, which writes every stream's lines: h11 frames each chunk in Python)."""

    class LingeringHttpTools(_Bounded, HttpToolsProtocol):
        # where the parser is: "idle" (between requests), "head" (a request's first bytes came, not all its
        # headers), "body" (its headers are in, not its whole body)
        _phase = "idle"
        _head_bytes = 0  # the bytes of the head under way (a request's line and headers) received so far
        _carry = b""  # the last bytes of it: the head's end (a blank line) may straddle two chunks

        def data_received(self, data: bytes) -> None:
            if self._lingering():
                self.transport.drop(len(data))
                return
            self._arm_header_timer()
            if self._phase != "body" and self._head_too_long(data):
                self._head_too_large()  # before the parser sees it
                return
            super().data_received(data)
            if self.parser is not None:  # None: the connection was lost meanwhile
                self._after_data()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._phase = "head"

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._phase = "body"
            self._head_bytes, self._carry = 0, b""

        def _head_too_long(self, data: bytes) -> bool:
            """Whether `data` takes the head under way (or beginning with it) past `MAX_HEAD_BYTES`: its end, the
            first blank line, not within the bound. Pure but for the count it keeps."""
            seen = self._carry + data
            end = seen.find(b"\r\n\r\n")
            if end >= 0:
                size = self._head_bytes + end + 4 - len(self._carry)
                self._head_bytes, self._carry = 0, b""
                return size > MAX_HEAD_BYTES
            self._head_bytes += len(data)
            self._carry = seen[-3:]
            return self._head_bytes > MAX_HEAD_BYTES

        def _head_too_large(self) -> None:
            """A request's head past `MAX_HEAD_BYTES` (h11 bounds its own, at 16 KiB: uvicorn's default): 431,
            closed. httptools parsed any: a 64 MB header took 5-6 s of the front's loop (every stream beside it
            paused 2.1 s) and 110 MB of its memory."""
            headers, body = refusal_response(431, "headers_too_large", f"the request's head is over {MAX_HEAD_BYTES} "
                                             "bytes", self.refusal)
            if self.cycle is None or self.cycle.response_complete:  # no response of this connection under way
                self._write(431, headers, body)
            self.transport.close()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._phase = "idle"

        def _awaiting_headers(self) -> bool:
            if self._phase == "idle":  # between requests, unless a response is still being written (h11's DONE)
                return self.cycle is None or bool(self.cycle.response_complete)
            return self._phase == "head"

        def _awaiting_body(self) -> bool:
            return self._phase == "body"

        def _write(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
            lines = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
            lines += [name + b": " + value + b"\r\n" for name, value in headers]
            self.transport.write(b"".join(lines) + b"\r\n" + body)

    for name, value in _settings(max_bytes, max_s, stats, header_timeout_s, body_timeout_s, refusal,
                                 send_timeout_s).items():
        setattr(LingeringHttpTools, name, value)
    return LingeringHttpTools
