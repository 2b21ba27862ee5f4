"""Commands: request/reply on `<prefix>.node.<node>.<service>.<op>` with typed replies and typed errors.

A single `request` goes through nats-py's own request (one muxed inbox, no responders detected by the server);
`request_all`, the dc_manager's hundreds at once, through an inbox subscription of its own, one timer and one wake-up
per loop pass for the whole call: nats-py's request costs a task and a timer per command, ~1.6x the CPU (docs/bus.md,
`holdfast bench controlplane --floor`). Invariants
(libs/common README 2 and 6): every command a handler takes is answered, with its reply model or a typed error
(`HoldfastError.code`, else `internal`), raised again on the caller's side as `RemoteError`; a command whose
envelope is addressed (`to`) to another node than its subject's is refused with `wrong_node`, never handled; one
that arrives more than `EXPIRY_SLACK_S` after its `expires` (its caller had stopped waiting: the receiver was
stopped, its queue backed up) is refused with `expired`, never handled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from pydantic import BaseModel

from libs.common import telemetry
from libs.common.bus import codec, frames
from libs.common.bus.connection import Link, server_answers
from libs.common.errors import (
    CommandTimeout,
    Expired,
    HoldfastError,
    MalformedMessage,
    RemoteError,
    Unavailable,
    WrongNode,
)
from libs.common.events import (
    Command,
    CommandEnvelope,
    ErrorBody,
    command_kind,
    command_subject,
    decode_model,
)

log = logging.getLogger("holdfast.bus")
# How much later than its `expires` (the sender's clock) a command is still run: room for two machines' clocks
# (NTP keeps them within milliseconds; a VM's may drift seconds). Past it the receiver refuses it (`Expired`).
EXPIRY_SLACK_S = 5.0

C = TypeVar("C", bound=Command)
R = TypeVar("R", bound=BaseModel)
T = TypeVar("T")


async def retried_unanswered(call: Callable[[], Awaitable[T]], attempts: int, backoff_s: float,
                             before_retry: Callable[[], Awaitable[None]] | None = None, *,
                             window_s: float = 0.0, link: Any = None, link_wait_s: float = 120.0) -> T:
    """`call()` (a command's request), sent again while nobody answers it (`CommandTimeout`, `Unavailable`): at least
    `attempts` times, and on while less than `window_s` has passed since the first (a service restarting answers
    nobody for a second or two: three tries 0.1 and 0.2 s apart all missed it, probe of 2026-12-07), waiting
    `backoff_s` doubled after each (at most a second, never past the window); a typed error reply is final, and
    the last unanswered try's error is raised. `before_retry`, awaited after each wait, may raise to give up (the
    caller's reason).

    `link` (the caller's nats-py connection): a try during which the caller's own connection was down (or came back),
    or after which its server does not answer a PING (a stalled server keeps the connection open and nats-py
    "connected"), is not the node's silence: its request or the answer waited in no one's hands. It is not counted:
    the call waits for the connection to answer again (up to `link_wait_s`) and starts its tries again (a 7 s NATS
    restart or stall failed the dc_manager's freeze, and an incident that its warm standby was taking over went to a
    cold start, or failed while the standby served; probe of 2026-12-07)."""
    t0 = time.monotonic()
    i = restarts = 0
    while True:
        seen = None if link is None else link.stats["reconnects"]
        try:
            return await call()
        except (CommandTimeout, Unavailable):
            if link is not None and not link.is_closed and restarts < LINK_RESTARTS \
                    and (link.stats["reconnects"] != seen or not await server_answers(link, LINK_PING_S)):
                await _connected(link, link_wait_s)
                t0, i, restarts = time.monotonic(), 0, restarts + 1
                if before_retry is not None:
                    await before_retry()
                continue
            pause = min(backoff_s * (2**i), 1.0)
            left = window_s - (time.monotonic() - t0)
            if i >= attempts - 1 and left <= pause:
                raise
            await asyncio.sleep(pause)
            i += 1
            if before_retry is not None:
                await before_retry()


LINK_RESTARTS = 5  # a connection that keeps flapping restarts a call's tries at most this often
LINK_PING_S = 0.5  # a PONG later than this: the caller's own server does not answer


async def _connected(nc: Any, within_s: float) -> None:
    """Until `nc`'s server answers again; raises CommandTimeout past `within_s`."""
    deadline = time.monotonic() + within_s
    while not await server_answers(nc, LINK_PING_S):
        if nc.is_closed or time.monotonic() > deadline:
            raise CommandTimeout(f"the bus connection did not come back in {within_s:g}s")
        await asyncio.sleep(0.05)


class Commands:
    def __init__(self, link: Link) -> None:
        self.link = link
        self._kinds: dict[type, str] = {}  # command class -> '<service>.<op>' (pydantic's class fields, once)

    def out(self, node: str, command: Command, traceparent: str | None,
            timeout_s: float | None = None) -> tuple[str, bytes]:
        """Its subject and body; the trace context travels in the body only (codec.py: no header); `timeout_s`:
        how long the caller waits (the envelope's `expires`)."""
        kind = self._kinds.get(type(command))
        if kind is None:
            kind = self._kinds[type(command)] = command_kind(type(command))
        carrier = {"traceparent": traceparent} if traceparent else telemetry.inject_headers()
        body = codec.command_body(command, source=self.link.source, to=node, traceparent=carrier.get("traceparent"),
                                  tracestate=carrier.get("tracestate"), timeout_s=timeout_s)
        return self.link.subjects.check(f"{self.link.prefix}.node.{node}.{kind}"), body

    async def request(self, node: str, command: Command, reply_model: type[R], *, timeout: float | None = None,
                      traceparent: str | None = None) -> R:
        limit = timeout or self.link.settings.request_timeout_s
        subject, body = self.out(node, command, traceparent, limit)
        try:
            msg = await self.link.nc.request(subject, body, timeout=limit)
        except NoRespondersError:
            raise Unavailable(f"no service answers {subject}") from None
        except NatsTimeout:
            raise CommandTimeout(f"{subject} did not answer in {limit}s") from None
        return reply_of(msg, subject, reply_model)

    async def request_all(self, calls: Sequence[tuple[str, Command, str | None]], reply_model: type[R], *,
                          timeout: float | None = None) -> AsyncIterator[list[tuple[int, R | HoldfastError]]]:
        """`request` for each (node, command, traceparent) of `calls`, all sent at once, one timer for all: yields,
        as they arrive (one list per loop pass that brought any), (position in `calls`, the typed reply or the
        `HoldfastError` that `request` raises: `Unavailable`, `RemoteError`, and `CommandTimeout` for each one
        still unanswered after `timeout`). Not retried. Closing the iterator early drops the replies to come."""
        limit = timeout or self.link.settings.request_timeout_s
        inbox = self.link.inbox
        prefix = await inbox.open()
        loop = asyncio.get_running_loop()
        replies = _Replies(len(calls))
        tokens: list[str] = []
        subjects: list[str] = []
        timer = loop.call_later(limit, replies.expire)
        nc, fast = self.link.nc, self.link.fast
        try:
            for i, (node, command, traceparent) in enumerate(calls):
                subject, body = self.out(node, command, traceparent, limit)
                token = inbox.expect(replies.put, i)
                tokens.append(token)
                subjects.append(subject)
                await frames.send(nc, subject, body, prefix + token, b"", fast=fast)
            answered = [False] * len(calls)
            while replies.left > 0 and not replies.expired or replies.arrived:
                if not replies.arrived:
                    replies.waiter = loop.create_future()
                    await replies.waiter
                    continue
                got, replies.arrived = replies.arrived, []
                out: list[tuple[int, R | HoldfastError]] = []
                for i, msg in got:
                    answered[i] = True
                    try:
                        out.append((i, reply_of(msg, subjects[i], reply_model)))
                    except HoldfastError as e:
                        out.append((i, e))
                yield out
            missing = [i for i, done in enumerate(answered) if not done]
            if missing:
                yield [(i, CommandTimeout(f"{subjects[i]} did not answer in {limit}s")) for i in missing]
        finally:
            timer.cancel()
            for token in tokens:
                inbox.forget(token)

    async def serve(self, node: str, command_type: type[C], handler: Callable[[C], Awaitable[BaseModel]], *,
                    queue: str = "", attach_trace: bool = True, inline: bool = False) -> Any:
        """Answer `command_type` addressed to `node` (or `*`: every node, each message's subject names its own).
        `attach_trace=False`: the handler publishes and requests nothing, so the caller's trace context is not
        made current. `inline=True`: the handler never waits on anything slow, so it answers in the
        subscription's own task (commands then answered one at a time, in order); otherwise each command is
        answered in a task of its own (a takeover waits on a process: it must not hold the others)."""
        link = self.link
        subject = command_subject(link.prefix, node, command_type)
        typed = codec.typed(CommandEnvelope, command_type)
        exact = "*" not in node and ">" not in node
        node_at = link.prefix.count(".") + 2  # '<prefix>.node.<node>.<service>.<op>'

        async def answer(msg: Msg) -> None:
            try:
                env = decode_model(typed, msg.data)  # envelope and command validated in one pass
                if env.to is not None and env.to != (node if exact else msg.subject.split(".")[node_at]):
                    raise WrongNode(f"{msg.subject} is node {node!r}'s; this command is addressed to {env.to!r}")
                if env.expires is not None and (late := time.time() - env.expires) > EXPIRY_SLACK_S:
                    raise Expired(f"{msg.subject} from {env.source} came {late:.1f} s after its caller stopped "
                                  f"waiting: not run")
                if attach_trace and (carrier := codec.trace_headers(env.trace)):
                    with telemetry.attach_headers(carrier):
                        result = await handler(env.data)
                else:
                    result = await handler(env.data)
                body = codec.ok_reply(result)
            except HoldfastError as e:
                if isinstance(e, MalformedMessage | WrongNode | Expired):
                    link.rejected += 1
                    log.warning("rejected command on %s: %s", msg.subject, e.message)
                err = e.to_dict()  # a RemoteError passed on keeps its remote code
                body = codec.error_reply(err["code"], err["message"])
            except Exception as e:  # noqa: BLE001 - a bug in a handler must not kill the service loop
                log.exception("command handler on %s failed", msg.subject)
                body = codec.error_reply("internal", f"{type(e).__name__}: {e}")
            if msg.reply:
                await msg.respond(body)

        async def spawn(msg: Msg) -> None:
            link.spawn(answer(msg), f"serve:{subject}")

        sub = await link.nc.subscribe(subject, queue=queue, cb=answer if inline else spawn)
        link.subs.append(sub)
        await settle(link.nc)
        return sub

    async def serve_raw(self, subject: str, handler: Callable[[bytes], Awaitable[bytes]]) -> Any:
        async def cb(msg: Msg) -> None:
            out = await handler(msg.data)
            if msg.reply:
                await msg.respond(out)

        full = subject if subject.startswith(self.link.prefix + ".") else f"{self.link.prefix}.{subject}"
        sub = await self.link.nc.subscribe(full, cb=cb)
        self.link.subs.append(sub)
        return sub


async def settle(nc: Any) -> None:
    """Return once the server has every command this connection queued before the call (a SUB: whoever asks
    next, from any connection, is answered, not told "no responders"). Two round trips: nats-py's flush writes
    its PING straight to the socket while earlier commands may still wait in its pending buffer for the flusher
    task, so one PONG can come back before the server has read them (seen in nats-server's trace: a SUB read
    after another connection's request); by the first PONG the flusher has written them, and the second PING
    follows them (tests/common/test_bus_serve_ready.py)."""
    await nc.flush()
    await nc.flush()


class _Replies:
    """The replies of one `request_all` call, by position, as they arrive; its caller is woken once per loop
    pass that brought any (not once per reply)."""

    __slots__ = ("arrived", "expired", "left", "waiter")

    def __init__(self, n: int) -> None:
        self.arrived: list[tuple[int, Msg]] = []
        self.left = n
        self.expired = False
        self.waiter: asyncio.Future[None] | None = None

    def put(self, i: int, msg: Msg) -> None:
        self.arrived.append((i, msg))
        self.left -= 1
        self._wake()

    def expire(self) -> None:
        self.expired = True
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def reply_of(msg: Msg, subject: str, reply_model: type[R]) -> R:
    if msg.headers and msg.headers.get("Status") == "503":  # the server's no-responders reply (request_all)
        raise Unavailable(f"no service answers {subject}")
    reply = decode_model(codec.typed_reply(reply_model), msg.data)  # one pass, data validated
    if not reply.ok:
        err = reply.error or ErrorBody(code="error", message="error reply without a body")
        raise RemoteError(err.code, err.message)
    if reply.data is None:
        return decode_model(reply_model, {})  # says what is missing
    return reply.data  # type: ignore[return-value]
