"""Commands: request/reply on `<prefix>.node.<node>.<service>.<op>` with typed replies and typed errors.

Requests go through nats-py's own request (one muxed inbox, no responders detected by the server). Invariants
(libs/common README 2 and 6): every command a handler takes is answered, with its reply model or a typed error
(`HoldfastError.code`, else `internal`), raised again on the caller's side as `RemoteError`; a command whose
envelope is addressed (`to`) to another node than its subject's is refused with `wrong_node`, never handled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from pydantic import BaseModel

from libs.common import telemetry
from libs.common.bus import codec
from libs.common.bus.connection import Link
from libs.common.errors import (
    CommandTimeout,
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

C = TypeVar("C", bound=Command)
R = TypeVar("R", bound=BaseModel)


class Commands:
    def __init__(self, link: Link) -> None:
        self.link = link
        self._kinds: dict[type, str] = {}  # command class -> '<service>.<op>' (pydantic's class fields, once)

    def out(self, node: str, command: Command, traceparent: str | None) -> tuple[str, bytes, dict[str, str]]:
        kind = self._kinds.get(type(command))
        if kind is None:
            kind = self._kinds[type(command)] = command_kind(type(command))
        headers = {"traceparent": traceparent} if traceparent else telemetry.inject_headers()
        body = codec.command_body(command, source=self.link.source, to=node, traceparent=headers.get("traceparent"),
                                  tracestate=headers.get("tracestate"))
        return f"{self.link.prefix}.node.{node}.{kind}", body, headers

    async def request(self, node: str, command: Command, reply_model: type[R], *, timeout: float | None = None,
                      traceparent: str | None = None) -> R:
        subject, body, headers = self.out(node, command, traceparent)
        limit = timeout or self.link.settings.request_timeout_s
        try:
            msg = await self.link.nc.request(subject, body, timeout=limit, headers=headers or None)
        except NoRespondersError:
            raise Unavailable(f"no service answers {subject}") from None
        except NatsTimeout:
            raise CommandTimeout(f"{subject} did not answer in {limit}s") from None
        return reply_of(msg, subject, reply_model)

    async def request_all(self, calls: Sequence[tuple[str, Command, str | None]], reply_model: type[R], *,
                          timeout: float | None = None) -> AsyncIterator[list[tuple[int, R | HoldfastError]]]:
        """`request` for each (node, command, traceparent) of `calls`, all sent at once: yields, as they arrive
        (one list per wake-up), (position in `calls`, the typed reply or the `HoldfastError` that `request`
        raises). Not retried. Closing the iterator early cancels the requests still waiting."""

        async def one(i: int, node: str, command: Command, traceparent: str | None) -> tuple[int, R | HoldfastError]:
            try:
                return i, await self.request(node, command, reply_model, timeout=timeout, traceparent=traceparent)
            except HoldfastError as e:
                return i, e

        # One callback per finished request and one waiter for all (asyncio.wait over the pending set would
        # re-register on every task at each wake-up: quadratic in a burst of hundreds).
        loop = asyncio.get_running_loop()
        arrived: list[tuple[int, R | HoldfastError]] = []
        waiter: list[asyncio.Future[None]] = [loop.create_future()]

        def landed(task: asyncio.Task[tuple[int, R | HoldfastError]]) -> None:
            if not task.cancelled():
                arrived.append(task.result())
            if not waiter[0].done():
                waiter[0].set_result(None)

        tasks = [loop.create_task(one(i, *call)) for i, call in enumerate(calls)]
        for task in tasks:
            task.add_done_callback(landed)
        left = len(tasks)
        try:
            while left > 0:
                if not arrived:
                    await waiter[0]
                    waiter[0] = loop.create_future()
                    continue
                got, arrived[:] = arrived[:], []
                left -= len(got)
                yield got
        finally:
            for task in tasks:
                task.cancel()

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
                if attach_trace:
                    with telemetry.attach_headers(msg.headers or {}):
                        result = await handler(env.data)
                else:
                    result = await handler(env.data)
                body = codec.ok_reply(result)
            except HoldfastError as e:
                if isinstance(e, MalformedMessage | WrongNode):
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


def reply_of(msg: Msg, subject: str, reply_model: type[R]) -> R:
    reply = decode_model(codec.typed_reply(reply_model), msg.data)  # one pass, data validated
    if not reply.ok:
        err = reply.error or ErrorBody(code="error", message="error reply without a body")
        raise RemoteError(err.code, err.message)
    if reply.data is None:
        return decode_model(reply_model, {})  # says what is missing
    return reply.data  # type: ignore[return-value]
