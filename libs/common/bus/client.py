"""`Bus`: one NATS connection with Holdfast's typing, tracing and error handling on top. It only composes the
seams (connection.py, publish.py, receive.py, durable.py, commands.py); each method says which one does it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import nats.errors
from pydantic import BaseModel

from libs.common.backoff import Backoff
from libs.common.bus import durable, receive
from libs.common.bus.commands import C, Commands, R, settle
from libs.common.bus.connection import Link, open_connection
from libs.common.bus.durable import BatchHandler, Consumer
from libs.common.bus.publish import Publisher, Wired
from libs.common.bus.receive import EventHandler, Vet
from libs.common.config import CommonSettings
from libs.common.errors import HoldfastError
from libs.common.events import Command, Envelope, Event

log = logging.getLogger("holdfast.bus")


class Bus:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.nc, self.js = link.nc, link.js
        self.settings, self.prefix, self.source = link.settings, link.prefix, link.source
        self.events = Publisher(link)
        self.commands = Commands(link)

    @property
    def rejected(self) -> int:
        """Malformed or refused messages dropped (health replies and tests show it)."""
        return self.link.rejected

    # ------------------------------------------------------------ lifecycle (connection.py)

    @classmethod
    async def connect(cls, settings: CommonSettings, source: str, *, stream: bool = True) -> Bus:
        link = Link(await open_connection(settings, source), settings, source)
        if stream:
            try:
                await link.ensure_stream()
            except BaseException:
                await link.nc.close()  # the caller gets no bus: its connection must not reconnect forever
                raise
        return cls(link)

    async def ensure_stream(self) -> None:
        await self.link.ensure_stream()

    async def close(self) -> None:
        await self.link.close()

    # ------------------------------------------------------------ events out (publish.py)

    def envelope(self, payload: Event, *, incident_id: str | None = None, id: str | None = None,
                 traceparent: str | None = None, node: str | None = None) -> Envelope:
        """Wrap `payload`. `id`: a chosen id (derived ids make re-publication idempotent); `traceparent`: the
        trace to file it under (default: the current span's context); `node`: the node it is about, where the
        payload does not say (an operator's or a simulated node's event; default: this connection's)."""
        return self.events.envelope(payload, incident_id=incident_id, id=id, traceparent=traceparent, node=node)

    def wired(self, payload: Event, *, id: str, traceparent: str | None = None,
              incident_id: str | None = None) -> Wired:
        """`envelope(...)` ready for `publish`/`publish_all` without the `Envelope` model (codec.py)."""
        return self.events.wired(payload, id=id, traceparent=traceparent, incident_id=incident_id)

    async def emit(self, payload: Event, *, incident_id: str | None = None, node: str | None = None) -> Envelope:
        env = self.envelope(payload, incident_id=incident_id, node=node)
        await self.events.publish(env)
        return env

    async def emit_until_stored(self, payload: Event, *, within_s: float = 120.0) -> Envelope:
        """`emit`, again and again until the server has it or `within_s` has passed (then the last error): for an
        event that must not be lost when the NATS server in use dies mid-publish (a fault detected, an engine
        ready). The same envelope each time: a durable event's id is its Nats-Msg-Id, so the stream stores it
        once however many tries reached it."""
        env = self.envelope(payload)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        backoff = Backoff(first_s=0.2, max_s=2.0)  # soon after a server is back; no storm while it is down
        while True:
            try:
                await self.events.publish(env)
                return env
            except (TimeoutError, nats.errors.Error, OSError) as e:
                if loop.time() >= deadline:
                    raise
                delay = backoff.next_delay()
                log.warning("%s %s not stored yet (%r, try %d); again in %.1f s", type(payload).__name__, env.id, e,
                            backoff.failures, delay)
                await asyncio.sleep(delay)

    async def publish(self, env: Envelope | Wired) -> None:
        await self.events.publish(env)

    async def publish_all(self, envs: list[Envelope] | list[Wired] | list[Envelope | Wired], *,
                          timeout: float = 2.0) -> None:
        """Publish `envs` in order and wait for every durable one's stream ack together (one timer for all).
        Raises like `publish` (nats TimeoutError, a stream error) when any ack is missing; a retry is
        idempotent (Nats-Msg-Id)."""
        await self.events.publish_all(envs, timeout=timeout)

    # ------------------------------------------------------------ events in (receive.py, durable.py)

    async def subscribe(self, subject: str, handler: EventHandler, *, queue: str = "") -> Any:
        """Core (not durable) subscription: live only. A node event's bare type means every node's."""
        return await receive.subscribe(self.link, subject, handler, queue=queue)

    async def replay(self, subject: str) -> list[Envelope]:
        return await receive.replay(self.link, subject)

    async def durable(self, subject: str, name: str, handler: EventHandler, *, new_only: bool = False,
                      concurrency: int = 1, ack_wait: float = 30, shared: bool = True,
                      attach_trace: bool = True, vet: Vet | None = None) -> Consumer:
        """JetStream durable pull consumer: resumes after a restart; each message acked after its handler
        succeeds. `concurrency`: handlers at once (order between messages then not kept). `ack_wait`: how long
        an unacked message waits before JetStream redelivers it (running ones are marked in progress). Several
        processes may read one durable (`shared`: always, with pull consumers; kept for its callers).
        `attach_trace=False`: the message's trace context is not made current. `vet`: receive.Vet."""
        return await durable.durable(self.link, subject, name, handler, new_only=new_only, concurrency=concurrency,
                                     ack_wait=ack_wait, attach_trace=attach_trace, vet=vet)

    async def durable_batches(self, subject: str, name: str, handler: BatchHandler, *, concurrency: int = 256,
                              ack_wait: float = 30, new_only: bool = False, shared: bool = True,
                              vet: Vet | None = None) -> Consumer:
        """`durable` for a handler of many events at once: each fetched batch goes to one `handler` call, which
        returns, in their order, None for each event handled (acked) or the exception that failed it (nak'd). A
        handler that raises fails them all. Events reach it without their trace context made current; their
        delivery counts are in `delivery_attempts`, in order."""
        return await durable.durable_batches(self.link, subject, name, handler, concurrency=concurrency,
                                             ack_wait=ack_wait, new_only=new_only, vet=vet)

    # ------------------------------------------------------------ commands (commands.py)

    async def request(self, node: str, command: Command, reply_model: type[R], *, timeout: float | None = None,
                      traceparent: str | None = None) -> R:
        """The typed reply; raises `Unavailable`, `CommandTimeout` or `RemoteError` (the handler's typed error).
        `traceparent`: the trace to file the command under (default: the current span's context)."""
        return await self.commands.request(node, command, reply_model, timeout=timeout, traceparent=traceparent)

    def request_all(self, calls: Sequence[tuple[str, Command, str | None]], reply_model: type[R], *,
                    timeout: float | None = None) -> AsyncIterator[list[tuple[int, R | HoldfastError]]]:
        return self.commands.request_all(calls, reply_model, timeout=timeout)

    async def serve(self, node: str, command_type: type[C], handler: Callable[[C], Awaitable[BaseModel]], *,
                    queue: str = "", attach_trace: bool = True, inline: bool = False) -> Any:
        return await self.commands.serve(node, command_type, handler, queue=queue, attach_trace=attach_trace,
                                         inline=inline)

    async def serve_raw(self, subject: str, handler: Callable[[bytes], Awaitable[bytes]]) -> Any:
        """Answer raw requests on `subject`; unlike `serve`, it returns before the server has the subscription
        (`settle` waits for that, once for several)."""
        return await self.commands.serve_raw(subject, handler)

    async def settle(self) -> None:
        """Return once the server has every subscription made before the call (commands.settle)."""
        await settle(self.nc)


