"""Events out: an `Envelope` (or its wire form, `Wired`) on its subject; durable types through JetStream.

A node's event (events.NODE_EVENTS) goes on `<prefix>.<type>.<node>`, the node its payload names (the simulated
cluster speaks for many nodes) or else this bus's; every other event on `<prefix>.<type>`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NoStreamResponseError

from libs.common import telemetry
from libs.common.bus import codec, frames
from libs.common.bus.connection import Link
from libs.common.events import Envelope, Event, TraceContext, event_subject


class Wired:
    """An event as it goes on the wire: subject, body (the JSON of the `Envelope` it stands for, `codec`),
    headers, whether it is durable, and its id."""

    __slots__ = ("body", "durable", "headers", "id", "subject")

    def __init__(self, subject: str, body: bytes, headers: dict[str, str], durable: bool, id: str) -> None:
        self.subject, self.body, self.headers, self.durable, self.id = subject, body, headers, durable, id


def event_headers(id: str, durable: bool) -> dict[str, str]:
    # A durable event carries its id as Nats-Msg-Id (the stream's deduplication key: a retried publish is
    # idempotent). Nothing else: the id and the trace context are in the envelope (codec.py), so a core event
    # needs no header, and a header costs bytes on every delivery (docs/bus.md, "Wire format").
    return {"Nats-Msg-Id": id} if durable else {}


class _AckBatch:
    """The stream acks one `publish_all` call waits for: done when all came, failed by the first error."""

    __slots__ = ("done", "left", "sealed")

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done
        self.left = 0  # acks still to come
        self.sealed = False  # every event is published (an early ack must not end the wait)

    def ack(self) -> None:
        self.left -= 1
        self.finish_if_complete()

    def seal(self) -> None:
        self.sealed = True
        self.finish_if_complete()

    def finish_if_complete(self) -> None:
        if self.sealed and self.left <= 0 and not self.done.done():
            self.done.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)

    def expire(self) -> None:
        self.fail(NatsTimeout())


class Publisher:
    def __init__(self, link: Link) -> None:
        self.link = link
        self._subjects: dict[tuple[type, str | None], str] = {}

    def node_of(self, payload: Event) -> str | None:
        """The node an event is about: its own `node`, else that of the engine or lease record it carries, else
        this connection's (receive.py refuses a node's event that names another node than its subject)."""
        node = codec.field(payload, "node")
        if node:
            return node  # type: ignore[no-any-return]
        return next((n for n in codec.carried_nodes(payload) if n), self.link.settings.node)

    def subject(self, cls: type[Event], node: str | None) -> str:
        key = (cls, node)
        subject = self._subjects.get(key)
        if subject is None:  # pydantic's class-level field lookup, once per (class, node); nats-py's check too
            subject = self._subjects[key] = self.link.subjects.check(event_subject(self.link.prefix, cls, node or ""))
        return subject

    def envelope(self, payload: Event, *, incident_id: str | None = None, id: str | None = None,
                 traceparent: str | None = None, node: str | None = None) -> Envelope:
        if traceparent is not None:
            trace = TraceContext(traceparent=traceparent)  # a known parent: no propagator round trip
        else:
            headers = telemetry.inject_headers()
            trace = TraceContext(traceparent=headers.get("traceparent"), tracestate=headers.get("tracestate"))
        extra = {"id": id} if id is not None else {}
        return Envelope(type=payload.type, source=self.link.source, node=node or self.node_of(payload),  # type: ignore[attr-defined]
                        incident_id=incident_id or codec.field(payload, "incident_id"), trace=trace,
                        data=payload, **extra)  # type: ignore[arg-type]

    def wired(self, payload: Event, *, id: str, traceparent: str | None = None,
              incident_id: str | None = None) -> Wired:
        if traceparent is not None:
            state = None
        else:
            carrier = telemetry.inject_headers()
            traceparent, state = carrier.get("traceparent"), carrier.get("tracestate")
        node = self.node_of(payload)
        body = codec.event_body(payload, id=id, source=self.link.source, node=node,
                                incident_id=incident_id or codec.field(payload, "incident_id"),
                                traceparent=traceparent, tracestate=state)
        durable = payload.durable
        return Wired(self.subject(type(payload), node), body, event_headers(id, durable), durable, id)

    def out(self, env: Envelope | Wired) -> tuple[str, bytes, dict[str, str], bool]:
        if isinstance(env, Wired):
            return env.subject, env.body, env.headers, env.durable
        durable = env.data.durable
        return self.subject(type(env.data), env.node), codec.envelope_body(env), event_headers(env.id, durable), durable

    async def publish(self, env: Envelope | Wired) -> None:
        subject, body, headers, durable = self.out(env)
        if durable:
            await self.link.js.publish(subject, body, headers=headers, timeout=2)
        else:
            await self.link.nc.publish(subject, body, headers=headers or None)

    async def publish_all(self, envs: list[Envelope] | list[Wired] | list[Envelope | Wired], *,
                          timeout: float = 2.0) -> None:
        tokens: list[str] = []
        # The stream acks come to the link's inbox (not js.publish_async: its pending-ack semaphore scans its
        # waiters on every acquire; docs/bus.md). Frames queued by `frames.send`: the subjects are checked once
        # each (`subject`), the reply is the inbox's (checked when opened) and a token of digits.
        inbox = self.link.inbox
        nc, fast = self.link.nc, self.link.fast
        prefix = await inbox.open()
        loop = asyncio.get_running_loop()
        batch = _AckBatch(loop.create_future())
        timer = None
        try:
            for env in envs:
                subject, body, headers, durable = self.out(env)
                head = frames.header_block(headers)
                if durable:
                    token = inbox.expect(_settle, batch)
                    tokens.append(token)
                    batch.left += 1
                    await frames.send(nc, subject, body, prefix + token, head, fast=fast)
                else:
                    await frames.send(nc, subject, body, "", head, fast=fast)
            if not tokens:
                return
            batch.seal()
            if not batch.done.done():
                timer = loop.call_later(timeout, batch.expire)
            await batch.done  # a stream error (no stream, wrong sequence...) or NatsTimeout is raised here
        finally:
            if timer is not None:
                timer.cancel()
            if batch.done.done() and not batch.done.cancelled():
                batch.done.exception()  # retrieved (raised above, or moot after another error): no warning
            for token in tokens:
                inbox.forget(token)


def _settle(batch: _AckBatch, msg: Msg) -> None:
    if batch.done.done():  # failed or timed out already: later acks are moot
        return
    if msg.headers and msg.headers.get("Status") == "503":
        batch.fail(NoStreamResponseError())
        return
    data = msg.data
    if data.startswith(b'{"stream":') and b'"error"' not in data:
        batch.ack()  # nats-server's PubAck ({"stream":...,"seq":...}): no JSON parse per ack
        return
    try:
        resp: Any = json.loads(data)
    except ValueError as e:
        batch.fail(e)
        return
    if "error" in resp:
        try:
            APIError.from_error(resp["error"])  # raises the typed error (it returns nothing)
        except APIError as e:
            batch.fail(e)
    else:
        batch.ack()
