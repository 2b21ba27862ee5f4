"""`RequestGuard`: the ASGI layer in front of an HTTP API (the admin API, the router) that decides from the
headers alone.

Before any byte of a body is read (and so before FastAPI parses anything):
1. a route that needs a token (any but the API's `public` ones, where it has a token table), asked without a known
   one: 401 (`WWW-Authenticate: Bearer`);
2. a declared `Content-Length` above `max_body_bytes`: 413.
Both answers carry `Connection: close`: the body is never read into the app, so a 50 MB body from an
unauthenticated client costs the service its headers, not its memory or its loop. The connection then closes
by lingering (linger.py): what the client still sends is dropped, bounded, so that it reads its answer.
A body without a declared length (chunked) is counted as it is read; past the limit the client gets 413 and
the app sees a disconnect. A body that is not complete within `body_timeout_s` of its headers is the protocol's
to refuse (408, linger.py), in the same error shape, and it tells the guard (`tell_refused`): counted and handed to
`on_refused` as the guard's own refusals are. Which routes need no token is each API's (the admin API's: `PUBLIC`); which scope
may do what is still decided per route (the admin API's `auth.py`, 403). The error body is each API's too
(`Refusal`: the admin API's `{"error", "message"}`, the router's OpenAI-shaped one, the batched engine's front's).
A HEAD request is served as the GET it asks about (FastAPI's routes take GET alone: HEAD /health was a 405); the
protocol, which knows it as HEAD, sends the headers without the body.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import ClientDisconnect

from libs.common.web.tokens import TokenTable

log = logging.getLogger("holdfast.web")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PUBLIC = frozenset({"/healthz", "/readyz", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
Refusal = Callable[[int, str, str], dict[str, Any]]  # (status, code, message) -> the JSON body answered
# The scope's key under which the guard leaves each request a hook for the refusals the HTTP protocol makes itself
# (linger.py: a body too slow, 408), which the app only sees as a disconnect.
REFUSED_HOOK = "holdfast.refused"


def tell_refused(scope: Scope, status: int) -> None:
    """The protocol refused this request (`status`): the guard in front of its app is told, if there is one."""
    hook = scope.get(REFUSED_HOOK)
    if hook is not None:
        hook(status)


def admin_refusal(_status: int, code: str, message: str) -> dict[str, Any]:
    """The admin API's error body."""
    return {"error": code, "message": message, "detail": None}


def verdict(path: str, headers: dict[bytes, bytes], admin_token: str, read_token: str,
            max_body_bytes: int) -> tuple[int, str, str] | None:
    """`decide` with the dev stack's plain tokens and the admin API's public routes."""
    return decide(path, headers, TokenTable().with_plain(admin_token, read_token), max_body_bytes)


def bearer_token(headers: dict[bytes, bytes]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None without one. Pure."""
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def decide(path: str, headers: dict[bytes, bytes], tokens: TokenTable | None, max_body_bytes: int,
           public: frozenset[str] = PUBLIC) -> tuple[int, str, str] | None:
    """(status, error code, message) to answer at once, or None to let the request in; `tokens` None: no token is
    asked for. Pure."""
    if tokens is not None and path not in public:
        token = bearer_token(headers)
        if token is None or tokens.scope_of(token) is None:
            return 401, "unauthorized", "missing or unknown bearer token"
    length = headers.get(b"content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            return 400, "bad_request", "Content-Length is not a number"
        if declared > max_body_bytes:
            return 413, "payload_too_large", f"the body ({declared} bytes) is over the limit of {max_body_bytes} bytes"
    return None


def once(raw: list[tuple[bytes, bytes]]) -> tuple[int, str, str] | None:
    """400 for a request with more than one Authorization header: this guard reads the last, a route's
    `HTTPBearer` the first, so one request could be let in by one token and audited or scoped by another. Pure."""
    if sum(1 for name, _ in raw if name == b"authorization") > 1:
        return 400, "bad_request", "more than one Authorization header"
    return None


def framed_by_length(headers: dict[bytes, bytes]) -> bool:
    """The body is framed by its Content-Length, so at most that many bytes arrive. Not where a Transfer-Encoding
    stands beside it: the chunks frame the body then and the length is ignored (RFC 9112 6.3; h11 does so), so a
    `Content-Length: 10` beside a chunked body of 20 MB let it past the limit uncounted (router and admin API). Pure."""
    return b"content-length" in headers and b"transfer-encoding" not in headers


def bodiless(headers: dict[bytes, bytes]) -> bool:
    """Neither a length nor a transfer coding: the request has no body (RFC 9112 6.3), nothing to count (a GET, or
    a stream's POST from a client that sends none: its every line went through the counting layer). Pure."""
    return b"content-length" not in headers and b"transfer-encoding" not in headers


def refusal_response(status: int, code: str, message: str,
                     refusal: Refusal = admin_refusal) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of a refusal that ends its connection: the guard's (401, 413, 400) and the protocol's
    408 for a body too slow (linger.py). Pure."""
    body = json.dumps(refusal(status, code, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return headers, body


async def answer(send: Send, status: int, code: str, message: str, refusal: Refusal = admin_refusal) -> None:
    headers, body = refusal_response(status, code, message, refusal)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, tokens: TokenTable | None,
                 max_body_bytes: int, public: frozenset[str] = PUBLIC, refusal: Refusal = admin_refusal,
                 on_refused: Callable[[Scope, int], None] | None = None) -> None:
        self.app = app
        # told of each request refused here (413, 400) or by the protocol (408, `tell_refused`), which the app never
        # sees as such (the admin API writes an authenticated token's attempts to change state to the audit record)
        self.on_refused = on_refused
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes
        self.public = public
        self.refusal = refusal
        self.refused = {401: 0, 413: 0, 400: 0, 408: 0}  # answered here (body unread), or by the protocol (408)

    def _refused(self, scope: Scope, status: int) -> None:
        self.refused[status] = self.refused.get(status, 0) + 1
        if status != 401 and self.on_refused is not None:
            self.on_refused(scope, status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        bad = once(scope["headers"]) or decide(scope["path"], headers, self.tokens, self.max_body_bytes, self.public)
        if bad is not None:
            self._refused(scope, bad[0])
            await answer(send, *bad, refusal=self.refusal)
            return
        scope[REFUSED_HOOK] = functools.partial(self._refused, scope)
        if scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}  # the protocol's own scope stays HEAD: it drops the body
        try:
            if framed_by_length(headers) or bodiless(headers):
                await self.app(scope, receive, send)  # at most the declared length arrives (HTTP framing)
            else:
                await self._counted(scope, receive, send)
        except ClientDisconnect:
            # The body never came whole: the client left, or the protocol refused it as too slow (408, linger.py).
            # Expected; uvicorn would log each as a traceback, a log to flood for anyone who can open connections.
            log.debug("%s %s: the client's body ended early", scope.get("method"), scope["path"])

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A body of unknown length: counted chunk by chunk; past the limit, 413 and a disconnect for the app."""
        read = 0
        state = {"started": False, "refused": False}

        async def counted_receive() -> Message:
            nonlocal read
            if state["refused"]:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                read += len(msg.get("body", b""))
                if read > self.max_body_bytes and not state["started"]:
                    state["refused"] = True
                    self._refused(scope, 413)
                    await answer(send, 413, "payload_too_large", f"the body is over the limit of {self.max_body_bytes} bytes",
                                 refusal=self.refusal)
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg: Message) -> None:
            if state["refused"]:
                return  # the 413 is the answer: the app's own reply to the disconnect is dropped
            state["started"] = True
            await send(msg)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not state["refused"]:
                raise  # the app's own failure; a refused body's disconnect is expected to end it
