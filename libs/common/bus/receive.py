"""Events in: decode, validate and check where an event comes from before any handler sees it.

Invariants (libs/common/README.md 1 and 8): a malformed message never reaches a handler and never stops a
subscription; a node's event whose envelope or payload names another node than its subject (the payload's own
`node`, or that of the engine or lease record it carries), or that a `Vet` refuses, never reaches a handler
either. Both are logged and counted (`Bus.rejected`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy

from libs.common import telemetry
from libs.common.bus import codec
from libs.common.bus.connection import Link
from libs.common.errors import HoldfastError, MalformedMessage, WrongNode
from libs.common.events import EngineInfo, Envelope, decode_event, subject_node, subscription_subject

log = logging.getLogger("holdfast.bus")

EventHandler = Callable[[Envelope], Awaitable[None]]
# Refuses an event (raises a HoldfastError) that its subscriber must never act on; returns None otherwise.
Vet = Callable[[Envelope], None]


# The fields by which an event names an engine by id (the record it may carry names one too: `vet` below).
_ENGINE_ID_FIELDS = ("engine_id", "predecessor_id", "owner")


def engines_on_their_nodes(engines: Mapping[str, EngineInfo]) -> Vet:
    """A `Vet` for events that name engines (a fault, an engine's or its memory's news): refused (`WrongNode`)
    when `engines` (the cluster's records) place one of them on another node than the event's. A node's identity
    may publish events only on its own node's subjects; this keeps it from faulting, stopping or re-announcing
    another node's engine on them. An engine not recorded (yet) is let through: whatever its incident does, it
    does on the event's own node."""

    def vet(env: Envelope) -> None:
        data = env.data
        named = [codec.field(data, name) for name in _ENGINE_ID_FIELDS]
        carried = codec.field(data, "engine")
        if carried is not None:
            named.append(carried.engine_id)
        for engine_id in named:
            engine = engines.get(engine_id) if engine_id else None
            if engine is not None and engine.node != env.node:
                raise WrongNode(f"node {env.node!r} names engine {engine_id!r}, which runs on node {engine.node!r}")

    return vet


def decode(link: Link, msg: Msg, vet: Vet | None = None) -> Envelope:
    """The event in `msg`: raises `MalformedMessage`, `WrongNode` (a node's event naming another node than its
    subject: forged by another node's identity, or misrouted) or what `vet` raises."""
    env = decode_event(msg.data)
    node = subject_node(link.prefix, msg.subject)
    if node is not None and (env.node != node or codec.field(env.data, "node") not in (None, "", node)
                             or any(n != node for n in codec.carried_nodes(env.data))):
        raise WrongNode(f"{msg.subject} is node {node!r}'s; its event says node {env.node!r} or describes "
                        f"another node's record")
    if vet is not None:
        vet(env)
    return env


def refused(link: Link, msg: Msg, e: HoldfastError) -> None:
    link.rejected += 1
    log.warning("refused message on %s: %s", msg.subject, e.message)


def event_callback(link: Link, handler: EventHandler, *, raise_errors: bool = False, attach_trace: bool = True,
                   vet: Vet | None = None) -> Callable[[Msg], Awaitable[None]]:
    """nats-py callback: decode, then run `handler` under the publisher's trace context. `raise_errors` (durable
    consumers): a malformed message or a failed handler is raised (terminated or redelivered); a refused event
    is not (it is handled: acked, never acted on)."""

    async def cb(msg: Msg) -> None:
        try:
            env = decode(link, msg, vet)
        except MalformedMessage as e:
            refused(link, msg, e)
            if raise_errors:
                raise
            return
        except HoldfastError as e:
            refused(link, msg, e)
            return
        try:
            if attach_trace and (carrier := codec.trace_headers(env.trace)):
                with telemetry.attach_headers(carrier):
                    await handler(env)
            else:  # nothing to propagate: skip the propagator
                await handler(env)
        except Exception:
            if raise_errors:
                raise
            log.exception("handler of %s failed on event %s", msg.subject, env.id)

    return cb


async def subscribe(link: Link, subject: str, handler: EventHandler, *, queue: str = "") -> Any:
    sub = await link.nc.subscribe(subscription_subject(link.prefix, subject), queue=queue,
                                  cb=event_callback(link, handler))
    link.subs.append(sub)
    return sub


async def replay(link: Link, subject: str) -> list[Envelope]:
    """Every stored event on `subject` (an ephemeral ordered consumer); for catch-up and tests."""
    out: list[Envelope] = []
    sub = await link.js.subscribe(subscription_subject(link.prefix, subject), ordered_consumer=True,
                                  config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.3)
            except NatsTimeout:
                break
            try:
                out.append(decode_event(msg.data))
            except MalformedMessage:
                link.rejected += 1
    finally:
        await sub.unsubscribe()
    return out
