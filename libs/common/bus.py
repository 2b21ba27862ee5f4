"""The NATS bus: typed events (durable through JetStream), typed commands as request/reply.

- `emit(payload)` wraps a payload in an `Envelope`, injects the current trace context into the message
  headers and publishes it; durable event types go through JetStream (acknowledged by the server).
- `subscribe(subject, handler)` decodes and validates every message; a malformed one is logged, counted
  in `bus.rejected` and dropped, and the subscription keeps serving.
- `durable(subject, name, handler)` is a JetStream durable consumer with explicit ack: a restarted
  subscriber with the same name resumes where it stopped. A handler that raises gets the message
  redelivered (bounded); a poison message is terminated.
- `request(node, command, reply_model)` / `serve(node, command_type, handler)`: commands with typed replies;
  a handler's `HoldfastError` travels back as a typed error reply and is raised again on the caller's side.

Handlers run one at a time per subscription (nats-py's rule): keep them short or hand work to a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StreamConfig
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError
from pydantic import BaseModel, create_model

from libs.common import security, telemetry
from libs.common.config import CommonSettings
from libs.common.errors import (
    CommandTimeout,
    HoldfastError,
    MalformedMessage,
    RemoteError,
    Unavailable,
    WrongNode,
)
from libs.common.events import (
    SCHEMA_VERSION,
    Command,
    CommandEnvelope,
    EngineInfo,
    Envelope,
    ErrorBody,
    Event,
    Reply,
    TraceContext,
    command_kind,
    command_subject,
    decode_event,
    decode_model,
    event_subject,
    subject_node,
    subscription_subject,
)
from libs.common.ids import new_id

log = logging.getLogger("holdfast.bus")

EventHandler = Callable[[Envelope], Awaitable[None]]
# Refuses an event (raises a HoldfastError) that its subscriber must never act on; returns None otherwise.
Vet = Callable[[Envelope], None]
# Many events at once -> for each, in order: None (handled) or the exception that failed it.
BatchHandler = Callable[[list[Envelope]], Awaitable[list[BaseException | None]]]
C = TypeVar("C", bound=Command)
R = TypeVar("R", bound=BaseModel)

MAX_DELIVER = 5
_VERSION_TIME = b',"version":' + str(SCHEMA_VERSION).encode() + b',"time":'

# Inside a durable handler: how many times JetStream has delivered this message (1: the first time). A
# handler whose progress is recorded elsewhere reads that record only on a redelivery.
delivery_attempt: contextvars.ContextVar[int] = contextvars.ContextVar("hf_delivery_attempt", default=0)
# Inside a `durable_batches` handler: each event's delivery count, in the order of the events handed over
# (empty outside one). Read it at the handler's start: the handler's own tasks copy it as it is then.
delivery_attempts: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar("hf_delivery_attempts",
                                                                                      default=())


def ok_reply(result: BaseModel) -> bytes:
    """`Reply(ok=True, data=result)` as JSON, byte for byte, without the dict round trip (dump to a dict,
    validate it into `Reply`, dump again): the result is a validated model already."""
    return b'{"ok":true,"data":' + result.model_dump_json().encode() + b',"error":null}'


def _num_delivered(msg: Msg) -> int:
    """The delivery count from a JetStream message's ack subject, without `msg.metadata` (which also parses
    timestamps into datetimes: ~2% of the controller at hundreds of messages a second)."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(tokens[4]) or 1
    if len(tokens) >= 11:  # $JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>...
        return int(tokens[6]) or 1
    return msg.metadata.num_delivered or 1


def engines_on_their_nodes(engines: Mapping[str, EngineInfo]) -> Vet:
    """A `Vet` for events that name an engine (a fault): refused (`WrongNode`) when `engines` (the cluster's
    records) place that engine on another node than the event's. A node's identity may publish events only on its
    own node's subjects; this keeps it from faulting another node's engine on them. An engine not recorded (yet)
    is let through: whatever its incident does, it does on the event's own node."""

    def vet(env: Envelope) -> None:
        engine_id = getattr(env.data, "engine_id", None)
        engine = engines.get(engine_id) if engine_id else None
        if engine is not None and engine.node != env.node:
            raise WrongNode(f"node {env.node!r} names engine {engine_id!r}, which runs on node {engine.node!r}")

    return vet


def spans_exported() -> bool:
    """Whether a finished span goes anywhere (a span processor, i.e. an exporter, is configured). Without
    one the SDK still builds each span and drops it (~30 us a span): hot paths skip optional spans then;
    the trace context itself still travels in the headers."""
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", None)
    return processors is None or bool(processors)  # a provider we do not know: assume it exports


@functools.cache
def _typed(base: type[BaseModel], data: type[BaseModel], *, optional: bool = False) -> type[Any]:
    """`base` (CommandEnvelope, Reply) with `data` typed as the given model: one JSON pass in and out instead
    of a dict in between. The JSON is the same as the untyped envelope's."""
    field: Any = (data | None, None) if optional else (data, ...)
    return create_model(f"{data.__name__}{base.__name__}", __base__=base, data=field)  # type: ignore[no-any-return]


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


async def beside(together: Awaitable[None], alone: dict[int, Awaitable[None]],
                 out: list[BaseException | None]) -> list[BaseException | None]:
    """For batch handlers (`durable_batches`): the batch's common part and the events handled one at a time (by
    position) run concurrently; each one-at-a-time handler's failure becomes its event's outcome in `out`, and a
    failure of the common part is raised (failing every event of the batch)."""
    if not alone:
        await together
        return out
    done = await asyncio.gather(together, *alone.values(), return_exceptions=True)
    for i, result in zip(alone, done[1:], strict=True):
        out[i] = result if isinstance(result, BaseException) else None
    if isinstance(done[0], BaseException):
        raise done[0]
    return out


@contextlib.asynccontextmanager
async def holding(locks: list[asyncio.Lock]) -> AsyncIterator[None]:
    """For batch handlers: every lock of the batch's items held for the block (taken in order, given back after)."""
    for lock in locks:
        await lock.acquire()
    try:
        yield
    finally:
        for lock in locks:
            lock.release()


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


def _consumer_config(name: str, new_only: bool, ack_wait: float, concurrency: int) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=name,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.NEW if new_only else DeliverPolicy.ALL,
        max_deliver=MAX_DELIVER,
        ack_wait=ack_wait,
        # Unacked messages waiting for a free slot get no in-progress marks: never let more than we run
        # be outstanding, or they would be redelivered under us while they wait.
        max_ack_pending=concurrency if concurrency > 1 else 1000,
    )


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(NatsTimeout())


def _json(value: str | None) -> bytes:
    # json.dumps's C string encoder without json.dumps's Python wrapper (what json.dumps(value) gives for a str)
    return b"null" if value is None else encode_basestring_ascii(value).encode()


def _event_headers(id: str, durable: bool, traceparent: str | None, tracestate: str | None) -> dict[str, str]:
    # The event's id: a durable event carries it as Nats-Msg-Id (the stream's deduplication key), a core one
    # as hf-id; not both (every header is a regex check and encodes in nats-py's publish).
    headers = {"Nats-Msg-Id": id} if durable else {"hf-id": id}
    if traceparent:
        headers["traceparent"] = traceparent
    if tracestate:
        headers["tracestate"] = tracestate
    return headers


class Wired:
    """An event as it goes on the wire (`Bus.wired`): subject, body and headers, built without an `Envelope`
    model. The body is the JSON of the `Envelope` that `Bus.envelope` would build, field for field (the same
    fields, order and values; strings escaped by `json`), so receivers decode and validate it the same way."""

    __slots__ = ("body", "durable", "headers", "id", "subject")

    def __init__(self, subject: str, body: bytes, headers: dict[str, str], durable: bool, id: str) -> None:
        self.subject, self.body, self.headers, self.durable, self.id = subject, body, headers, durable, id


def nats_auth(settings: CommonSettings, source: str) -> dict[str, Any]:
    """nats.connect's options for this connection's identity: TLS against the cluster's CA, the identity's nkey
    (its seed is read by nats-py only to sign the server's nonce) and its own inbox prefix (the server lets it
    read replies there only). `insecure`: none of it, for a server with auth off."""
    if settings.insecure:
        return {}
    creds = security.credentials_for(settings.credentials(), source, settings.node)
    return {"tls": creds.client_tls(), "nkeys_seed": str(creds.nkey_seed),
            "inbox_prefix": security.policy.inbox_prefix(creds.identity)}


class Bus:
    """One NATS connection with Holdfast's typing, tracing and error handling on top."""

    def __init__(self, nc: NATS, settings: CommonSettings, source: str) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.prefix = settings.subject_prefix
        self.source = source
        self.rejected = 0  # malformed messages dropped (visible in health replies and tests)
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._tickers: list[asyncio.Task[None]] = []  # durable consumers' in-progress tickers
        # publish_all's stream acks and request's replies come to one inbox subscription (_inbox), matched to
        # their waiters by a counter's token.
        self._inbox_prefix: str | None = None
        self._tokens = itertools.count()
        self._acks: dict[str, _AckBatch] = {}
        self._replies: dict[str, asyncio.Future[Msg]] = {}
        self._batched: dict[str, tuple[_Replies, int]] = {}  # request_all's replies: token -> (its call, position)
        self._subjects: dict[type, str] = {}
        self._source_json: bytes | None = None  # ',"source":...,"node":...' of this bus's envelopes (wired)
        self._command_head: bytes | None = None  # the same for its command envelopes
        self._command_kinds: dict[type, str] = {}  # command class -> '<service>.<op>', the end of its subject

    # ------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(cls, settings: CommonSettings, source: str, *, stream: bool = True) -> Bus:
        async def error_cb(e: Exception) -> None:
            log.warning("nats error: %s", e)

        async def disconnected_cb() -> None:
            if not (nc.is_closed or nc.is_draining):  # a close we asked for is not news
                log.warning("nats disconnected; reconnecting")

        async def reconnected_cb() -> None:
            log.info("nats reconnected")

        nc = await nats.connect(
            servers=[s.strip() for s in settings.nats_url.split(",")],
            name=source,
            **nats_auth(settings, source),
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            connect_timeout=2,
        )
        bus = cls(nc, settings, source)
        if stream:
            try:
                await bus.ensure_stream()
            except BaseException:
                # The caller gets no bus: the connection must not live on, reconnecting forever (it did, in the
                # test process, after a NATS cluster that refused the stream at first was stopped).
                await nc.close()
                raise
        return bus

    async def ensure_stream(self) -> None:
        """Create (or keep) the stream that holds every durable event subject, with `stream_replicas` copies
        (on a NATS cluster: the stream outlives a server, its consumers' state too, as they inherit them)."""
        subjects = [f"{self.prefix}.{kind}.>" for kind in ("fault", "incident", "intent", "memory", "engine", "router", "node.gpu")]
        config = StreamConfig(
            name=self.settings.stream_name,
            subjects=subjects,
            retention=RetentionPolicy.LIMITS,
            max_age=24 * 3600,
            max_msgs=1_000_000,
            num_replicas=self.settings.stream_replicas,
        )
        try:
            await self.js.stream_info(self.settings.stream_name)
            await self.js.update_stream(config)
        except NotFoundError:
            await self.js.add_stream(config)

    async def close(self) -> None:
        for ticker in self._tickers:
            ticker.cancel()
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=2)
        except Exception:  # noqa: BLE001 - closing is best effort; the server may already be gone
            pass
        if not self.nc.is_closed:
            await self.nc.close()

    # ------------------------------------------------------------ events

    def node_of(self, payload: Event) -> str | None:
        """The node an event is from: the node its payload names (the simulated cluster speaks for many), else
        this bus's."""
        return getattr(payload, "node", None) or self.settings.node

    def envelope(self, payload: Event, *, incident_id: str | None = None, id: str | None = None,
                 traceparent: str | None = None) -> Envelope:
        """Wrap `payload`. `id`: a chosen id (derived ids make re-publication idempotent); `traceparent`: the
        trace to file it under (default: the current span's context)."""
        if traceparent is not None:
            trace = TraceContext(traceparent=traceparent)  # a known parent: no propagator round trip
        else:
            headers = telemetry.inject_headers()
            trace = TraceContext(traceparent=headers.get("traceparent"), tracestate=headers.get("tracestate"))
        incident = incident_id or getattr(payload, "incident_id", None)
        extra = {"id": id} if id is not None else {}
        # Validated, not model_construct: the payload instance is checked by its class only, and pydantic's
        # model_construct (a Python loop over the fields) measured slower (4.5 against 3.9 us).
        return Envelope(
            type=payload.type,  # type: ignore[attr-defined]
            source=self.source,
            node=self.node_of(payload),
            incident_id=incident,
            trace=trace,
            data=payload,  # type: ignore[arg-type]
            **extra,
        )

    def wired(self, payload: Event, *, id: str, traceparent: str | None = None,
              incident_id: str | None = None) -> Wired:
        """`envelope(payload, id=, traceparent=, incident_id=)` ready for `publish`/`publish_all`, without the
        `Envelope` model: ~half the CPU of building the model and dumping it (the controller publishes five
        events per incident). For events this process publishes and does not read back."""
        if traceparent is not None:
            state = None
        else:
            carrier = telemetry.inject_headers()
            traceparent, state = carrier.get("traceparent"), carrier.get("tracestate")
        incident = incident_id or getattr(payload, "incident_id", None)
        if self._source_json is None:  # the fields every envelope of this bus shares
            self._source_json = b',"source":' + _json(self.source) + b',"node":'
        node = self.node_of(payload)
        body = b"".join((b'{"id":', _json(id), b',"type":', _json(payload.type),  # type: ignore[attr-defined]
                         _VERSION_TIME, repr(time.time()).encode(), self._source_json, _json(node), b',"incident_id":', _json(incident),
                         b',"trace":{"traceparent":', _json(traceparent), b',"tracestate":', _json(state), b'},"data":',
                         payload.model_dump_json().encode(), b"}"))
        durable = payload.durable
        return Wired(self._subject(type(payload), node), body, _event_headers(id, durable, traceparent, state), durable, id)

    async def emit(self, payload: Event, *, incident_id: str | None = None) -> Envelope:
        env = self.envelope(payload, incident_id=incident_id)
        await self.publish(env)
        return env

    async def publish(self, env: Envelope | Wired) -> None:
        subject, body, headers, durable = self._out(env)
        if durable:
            # Msg-Id makes a retried publish idempotent inside the stream's duplicate window.
            await self.js.publish(subject, body, headers=headers, timeout=2)
        else:
            await self.nc.publish(subject, body, headers=headers)

    async def publish_all(self, envs: list[Envelope] | list[Wired] | list[Envelope | Wired], *,
                          timeout: float = 2.0) -> None:
        """Publish `envs` in order and wait for every durable one's stream ack together: one timer for all,
        no request (and timer) per event. Raises like `publish` (nats TimeoutError, a stream error) when
        any ack is missing; a retry is idempotent (Msg-Id)."""
        # Not js.publish_async: its pending-ack semaphore scans its waiters on every acquire (~5% of the
        # controller in a burst); acks here are bounded by the callers' own concurrency.
        # One future for the whole call, completed by its last ack (or its first error), and one timer: not a
        # future per event and asyncio.wait's callbacks on each.
        tokens: list[str] = []
        prefix = self._inbox_prefix or await self._inbox()
        loop = asyncio.get_running_loop()
        batch = _AckBatch(loop.create_future())
        timer = None
        try:
            for env in envs:
                subject, body, headers, durable = self._out(env)
                if durable:
                    token = str(next(self._tokens))
                    tokens.append(token)
                    self._acks[token] = batch
                    batch.left += 1
                    await self.nc.publish(subject, body, reply=prefix + token, headers=headers)
                else:
                    await self.nc.publish(subject, body, headers=headers)
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
                self._acks.pop(token, None)

    async def _inbox(self) -> str:
        """One inbox subscription of ours for both stream acks (publish_all) and command replies (request), each
        message routed by its token (one counter hands out both kinds)."""
        prefix = f"{self.nc.new_inbox()}."

        async def on_message(msg: Msg) -> None:
            token = msg.subject[len(prefix):]
            waiter = self._replies.pop(token, None)
            if waiter is not None:
                if not waiter.done():
                    waiter.set_result(msg)
                return
            batched = self._batched.pop(token, None)
            if batched is not None:
                batched[0].put(batched[1], msg)
                return
            batch = self._acks.pop(token, None)
            if batch is None or batch.done.done():
                return
            if msg.headers and msg.headers.get("Status") == "503":
                batch.fail(NoStreamResponseError())
                return
            data = msg.data
            if data.startswith(b'{"stream":') and b'"error"' not in data:
                batch.ack()  # nats-server's PubAck ({"stream":...,"seq":...}): no JSON parse per ack
                return
            try:
                resp = json.loads(data)
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

        self._subs.append(await self.nc.subscribe(prefix + "*", cb=on_message))
        self._inbox_prefix = prefix
        return prefix

    def _out(self, env: Envelope | Wired) -> tuple[str, bytes, dict[str, str], bool]:
        if isinstance(env, Wired):
            return env.subject, env.body, env.headers, env.durable
        return (*self._wire(env), env.data.durable)

    def _subject(self, cls: type, node: str | None) -> str:
        subject = self._subjects.get(cls)
        if subject is None:  # once per event class (pydantic's class-level field lookup is not free)
            subject = self._subjects[cls] = event_subject(self.prefix, cls, "")
        return subject + node if subject.endswith(".") and node else subject

    def _wire(self, env: Envelope) -> tuple[str, bytes, dict[str, str]]:
        headers = _event_headers(env.id, env.data.durable, env.trace.traceparent, env.trace.tracestate)
        return self._subject(type(env.data), env.node), env.model_dump_json().encode(), headers

    async def subscribe(self, subject: str, handler: EventHandler, *, queue: str = "") -> Any:
        """Core (not durable) subscription to events: live only, fastest path."""
        sub = await self.nc.subscribe(self._full(subject), queue=queue, cb=self._event_cb(handler))
        self._subs.append(sub)
        return sub

    async def durable(self, subject: str, name: str, handler: EventHandler, *, new_only: bool = False,
                      concurrency: int = 1, ack_wait: float = 30, shared: bool = False,
                      attach_trace: bool = True) -> Any:
        """JetStream durable consumer: resumes after a restart; ack after the handler succeeds.

        `concurrency` > 1 runs up to that many handlers at once (each message acked when its own handler
        finishes; ordering between messages is then not kept). `ack_wait` is how long an unacked message
        waits before JetStream redelivers it (to this or the next subscriber of `name`); a running handler
        keeps its message marked in progress so slow work is not redelivered under it. `shared`: several
        processes bind the same durable (a deliver group named `name`), each message goes to one of them;
        without it a second process cannot bind a durable that another one holds. `attach_trace=False`: the
        handler files its work under a trace of its own choosing, so the message's context is not made current.
        """
        config = _consumer_config(name, new_only, ack_wait, concurrency)
        inner = self._event_cb(handler, raise_errors=True, attach_trace=attach_trace)

        async def handle(msg: Msg) -> None:
            try:
                delivery_attempt.set(_num_delivered(msg))
                await inner(msg)
            except MalformedMessage:
                await msg.term()  # poison: never redeliver
                return
            except Exception:  # noqa: BLE001 - the handler failed; let JetStream redeliver later
                log.exception("handler of %s failed; message will be redelivered", msg.subject)
                await msg.nak(delay=0.5)
                return
            await msg.ack()

        if concurrency <= 1:
            cb = handle
        else:
            slots = asyncio.Semaphore(concurrency)
            loop = asyncio.get_running_loop()
            running = self._in_progress(name, ack_wait)

            async def run(msg: Msg) -> None:
                running[id(msg)] = (msg, loop.time())
                try:
                    await handle(msg)
                except Exception:  # noqa: BLE001 - ack/nak failed (connection lost): JetStream redelivers
                    log.warning("could not settle a message on %s", msg.subject)
                finally:
                    running.pop(id(msg), None)
                    slots.release()

            async def cb(msg: Msg) -> None:
                await slots.acquire()  # backpressure: at most `concurrency` handlers in flight
                task = asyncio.create_task(run(msg), name=f"durable:{name}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        sub = await self.js.subscribe(self._full(subject), durable=name, cb=cb, manual_ack=True, config=config,
                                      queue=name if shared else None)
        self._subs.append(sub)
        return sub

    async def durable_batches(self, subject: str, name: str, handler: BatchHandler, *, concurrency: int = 256,
                              ack_wait: float = 30, new_only: bool = False, shared: bool = False,
                              vet: Vet | None = None) -> Any:
        """`durable(..., concurrency=, attach_trace=False)` for a handler of many events at once: the messages
        delivered in one loop pass go to one `handler` call (one task for them all, not one each), which
        returns, in their order, None for each event handled (acked) or the exception that failed it (nak'd,
        redelivered later). A handler that raises fails them all. A malformed message is terminated and not
        handed on. Each message holds one of `concurrency` slots until it is settled, and is marked in
        progress while it runs, as with `durable`. Events reach the handler without their message's trace
        context made current (the handler files its work under traces of its own). Each event's delivery count
        (`delivery_attempt` of a one-at-a-time handler) is in `delivery_attempts`, in the events' order. `vet(env)`
        may refuse an event by raising a `HoldfastError`: it is then logged, counted and acked, never handed on."""
        config = _consumer_config(name, new_only, ack_wait, concurrency)
        slots = asyncio.Semaphore(concurrency)
        loop = asyncio.get_running_loop()
        running = self._in_progress(name, ack_wait)
        gathered: list[Msg] = []  # delivered in this loop pass, not yet handed to a batch

        async def settle(msg: Msg, error: BaseException | None) -> None:
            try:
                if error is None:
                    await msg.ack()
                elif isinstance(error, MalformedMessage):
                    await msg.term()  # poison: never redeliver
                else:
                    log.error("handler of %s failed; message will be redelivered", msg.subject, exc_info=error)
                    await msg.nak(delay=0.5)
            except Exception:  # noqa: BLE001 - ack/nak failed (connection lost): JetStream redelivers
                log.warning("could not settle a message on %s", msg.subject)

        async def run(msgs: list[Msg]) -> None:
            try:
                envs: list[Envelope] = []
                handed: list[Msg] = []
                attempts: list[int] = []
                for msg in msgs:
                    try:
                        envs.append(self._decode(msg, vet))
                        handed.append(msg)
                        attempts.append(_num_delivered(msg))
                    except MalformedMessage as e:
                        self.rejected += 1
                        log.warning("rejected message on %s: %s", msg.subject, e.message)
                        await settle(msg, e)
                    except HoldfastError as e:
                        self._refused(msg, e)
                        await settle(msg, None)  # acked: never acted on, never redelivered
                delivery_attempts.set(tuple(attempts))  # this task's own context: per batch
                try:
                    outcomes = await handler(envs) if envs else []
                except Exception as e:  # noqa: BLE001 - every event of the batch is redelivered
                    outcomes = [e] * len(envs)
                for msg, error in zip(handed, outcomes, strict=True):
                    await settle(msg, error)
            finally:
                for msg in msgs:
                    running.pop(id(msg), None)
                    slots.release()

        def start() -> None:
            msgs = gathered.copy()
            gathered.clear()
            task = loop.create_task(run(msgs), name=f"durable:{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        async def cb(msg: Msg) -> None:
            await slots.acquire()  # backpressure: at most `concurrency` messages in flight
            running[id(msg)] = (msg, loop.time())
            if not gathered:
                loop.call_soon(start)  # after nats-py has handed over what it read in this pass
            gathered.append(msg)

        sub = await self.js.subscribe(self._full(subject), durable=name, cb=cb, manual_ack=True, config=config,
                                      queue=name if shared else None)
        self._subs.append(sub)
        return sub

    def _in_progress(self, name: str, ack_wait: float) -> dict[int, tuple[Msg, float]]:
        """Messages being handled, by identity (id -> the message, when it started), and one shared ticker
        that marks the long-running ones in progress (not a task and a timer per message: at hundreds of
        messages a second those cost more than the handlers). Period ack_wait/4 and age >= ack_wait/4: every
        message is marked before it is ack_wait/2 old, then every ack_wait/4, well inside ack_wait."""
        loop = asyncio.get_running_loop()
        running: dict[int, tuple[Msg, float]] = {}
        period = max(ack_wait / 4, 0.05)

        async def keep_in_progress() -> None:
            while True:
                await asyncio.sleep(period)
                now = loop.time()
                for msg, started in list(running.values()):
                    if now - started >= period:
                        with contextlib.suppress(Exception):
                            await msg.in_progress()

        self._tickers.append(asyncio.create_task(keep_in_progress(), name=f"in-progress:{name}"))
        return running

    async def replay(self, subject: str, *, start_seq: int = 1) -> list[Envelope]:
        """Read every stored event on `subject` (ephemeral ordered consumer); for catch-up and tests."""
        out: list[Envelope] = []
        sub = await self.js.subscribe(
            self._full(subject), ordered_consumer=True, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        )
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.3)
                except NatsTimeout:
                    break
                try:
                    out.append(decode_event(msg.data))
                except MalformedMessage:
                    self.rejected += 1
        finally:
            await sub.unsubscribe()
        return out

    def _full(self, subject: str) -> str:
        return subscription_subject(self.prefix, subject)

    def _decode(self, msg: Msg, vet: Vet | None = None) -> Envelope:
        """The event in `msg`, from where its subject says: raises `MalformedMessage`, or `WrongNode` for a node
        event whose envelope (or payload) names another node than its subject (forged by another node's identity,
        which the server lets publish only on its own node's subjects), or what `vet` raises."""
        env = decode_event(msg.data)
        node = subject_node(self.prefix, msg.subject)
        if node is not None and (env.node != node or getattr(env.data, "node", None) not in (None, "", node)):
            raise WrongNode(f"{msg.subject} is node {node!r}'s; its event says node {env.node!r}")
        if vet is not None:
            vet(env)
        return env

    def _refused(self, msg: Msg, e: HoldfastError) -> None:
        self.rejected += 1
        log.warning("refused event on %s: %s", msg.subject, e.message)

    def _event_cb(self, handler: EventHandler, *, raise_errors: bool = False,
                  attach_trace: bool = True, vet: Vet | None = None) -> Callable[[Msg], Awaitable[None]]:
        async def cb(msg: Msg) -> None:
            try:
                env = self._decode(msg, vet)
            except MalformedMessage as e:
                self.rejected += 1
                log.warning("rejected message on %s: %s", msg.subject, e.message)
                if raise_errors:
                    raise
                return
            except HoldfastError as e:  # from another node than it says: handled (a durable one is acked), never acted on
                self._refused(msg, e)
                return
            headers = msg.headers
            try:
                if attach_trace and headers and "traceparent" in headers:
                    with telemetry.attach_headers(headers):
                        await handler(env)
                else:  # nothing to propagate: skip the propagator
                    await handler(env)
            except Exception:
                if raise_errors:
                    raise
                log.exception("handler of %s failed on event %s", msg.subject, env.id)

        return cb

    # ------------------------------------------------------------ commands

    async def request(
        self, node: str, command: Command, reply_model: type[R], *, timeout: float | None = None,
        traceparent: str | None = None,
    ) -> R:
        """`traceparent`: the trace to file the command under (default: the current span's context)."""
        subject, body, headers = self._command_out(node, command, traceparent)
        # Not nc.request: its token is a NUID built digit by digit in Python and its wait an asyncio.wait_for
        # (a second future and callbacks); here a counter's token and one timer (~2-3% of the dc_manager,
        # which sends two commands per incident). Same semantics: no responders, timeout, typed reply.
        limit = timeout or self.settings.request_timeout_s
        prefix = self._inbox_prefix or await self._inbox()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Msg] = loop.create_future()
        self._replies[token] = waiter
        timer = loop.call_later(limit, _expire, waiter)
        try:
            await self.nc.publish(subject, body, reply=prefix + token, headers=headers or None)
            msg = await waiter
        except NatsTimeout:
            raise CommandTimeout(f"{subject} did not answer in {limit}s") from None
        finally:
            timer.cancel()
            self._replies.pop(token, None)
        return self._reply_of(msg, subject, reply_model)

    async def request_all(self, calls: Sequence[tuple[str, Command, str | None]], reply_model: type[R], *,
                          timeout: float | None = None) -> AsyncIterator[list[tuple[int, R | HoldfastError]]]:
        """`request(node, command, reply_model, timeout=, traceparent=)` for each (node, command, traceparent) of
        `calls`, all sent at once, one timer for all: yields, as they arrive (one list per loop pass that brought
        any), (position in `calls`, the typed reply or the `HoldfastError` that `request` would raise:
        `Unavailable`, `RemoteError`, and `CommandTimeout` for each one still unanswered after `timeout`). Not
        retried. Closing the iterator early drops the replies still to come."""
        limit = timeout or self.settings.request_timeout_s
        prefix = self._inbox_prefix or await self._inbox()
        loop = asyncio.get_running_loop()
        replies = _Replies(len(calls))
        tokens: list[str] = []
        subjects: list[str] = []
        timer = loop.call_later(limit, replies.expire)
        try:
            for i, (node, command, traceparent) in enumerate(calls):
                subject, body, headers = self._command_out(node, command, traceparent)
                token = str(next(self._tokens))
                self._batched[token] = (replies, i)
                tokens.append(token)
                subjects.append(subject)
                await self.nc.publish(subject, body, reply=prefix + token, headers=headers or None)
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
                        out.append((i, self._reply_of(msg, subjects[i], reply_model)))
                    except HoldfastError as e:
                        out.append((i, e))
                yield out
            missing = [i for i, done in enumerate(answered) if not done]
            if missing:
                yield [(i, CommandTimeout(f"{subjects[i]} did not answer in {limit}s")) for i in missing]
        finally:
            timer.cancel()
            for token in tokens:
                self._batched.pop(token, None)

    def _command_out(self, node: str, command: Command, traceparent: str | None) -> tuple[str, bytes, dict[str, str]]:
        kind = self._command_kinds.get(type(command))
        if kind is None:  # once per command class: `command_kind` reads pydantic's class fields (not free)
            kind = self._command_kinds[type(command)] = command_kind(type(command))
        subject = f"{self.prefix}.node.{node}.{kind}"  # command_subject(self.prefix, node, type(command))
        headers = {"traceparent": traceparent} if traceparent else telemetry.inject_headers()
        return subject, self._command_json(command, headers.get("traceparent"), headers.get("tracestate"), node), headers

    @staticmethod
    def _reply_of(msg: Msg, subject: str, reply_model: type[R]) -> R:
        if msg.headers and msg.headers.get("Status") == "503":
            raise Unavailable(f"no service answers {subject}")
        reply = decode_model(_typed(Reply, reply_model, optional=True), msg.data)  # one pass, data validated
        if not reply.ok:
            err = reply.error or ErrorBody(code="error", message="error reply without a body")
            raise RemoteError(err.code, err.message)
        if reply.data is None:
            return decode_model(reply_model, {})  # says what is missing
        return reply.data  # type: ignore[no-any-return]

    def _command_json(self, command: Command, traceparent: str | None, tracestate: str | None, node: str) -> bytes:
        """The JSON of `CommandEnvelope(id=new_id(), source=, trace=, data=command)`, field for field, built
        without the model (its construction and dump were ~3x this; the dc_manager sends two per incident)."""
        if self._command_head is None:
            self._command_head = b',"source":' + _json(self.source) + b',"trace":{"traceparent":'
        return b"".join((b'{"id":', _json(new_id()), _VERSION_TIME, repr(time.time()).encode(), self._command_head,
                         _json(traceparent), b',"tracestate":', _json(tracestate), b'},"to":', _json(node), b',"data":',
                         command.model_dump_json().encode(), b"}"))

    async def serve(
        self,
        node: str,
        command_type: type[C],
        handler: Callable[[C], Awaitable[BaseModel]],
        *,
        queue: str = "",
        attach_trace: bool = True,
        inline: bool = False,
    ) -> Any:
        """Answer `command_type` addressed to `node`; every failure becomes a typed error reply.
        `attach_trace=False`: the handler publishes and requests nothing, so the caller's trace context is not
        made current (the propagator's extract and attach per command: ~9% of the benchmark's simulated nodes).
        `inline=True`: the handler never waits on anything slow, so it answers in the subscription's own task
        (no task per command; commands are then answered one at a time, in order)."""
        subject = command_subject(self.prefix, node, command_type)

        async def spawn(msg: Msg) -> None:
            # Commands may take a while (a takeover waits on a process): answer each in its own task so
            # one slow command does not hold the others queued behind it.
            task = asyncio.create_task(answer(msg), name=f"serve:{subject}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        typed = _typed(CommandEnvelope, command_type)
        exact = "*" not in node and ">" not in node  # a wildcard serves many nodes: each message's subject names its
        node_at = self.prefix.count(".") + 2  # '<prefix>.node.<node>.<service>.<op>'

        async def answer(msg: Msg) -> None:
            try:
                env = decode_model(typed, msg.data)  # envelope and command validated in one pass
                if env.to is not None and env.to != (node if exact else msg.subject.split(".")[node_at]):
                    # misrouted or forged (the subject names one node, the envelope another): never acted on
                    raise WrongNode(f"{msg.subject} is node {node!r}'s; this command is addressed to {env.to!r}")
                command = env.data
                if attach_trace:
                    with telemetry.attach_headers(msg.headers or {}):
                        result = await handler(command)
                else:
                    result = await handler(command)
                body = ok_reply(result)
            except HoldfastError as e:
                if isinstance(e, MalformedMessage | WrongNode):
                    self.rejected += 1
                    log.warning("rejected command on %s: %s", msg.subject, e.message)
                err = e.to_dict()
                reply = Reply(ok=False, error=ErrorBody(code=err["code"], message=err["message"]))
                body = reply.model_dump_json().encode()
            except Exception as e:  # noqa: BLE001 - a bug in a handler must not kill the service loop
                log.exception("command handler on %s failed", msg.subject)
                reply = Reply(ok=False, error=ErrorBody(code="internal", message=f"{type(e).__name__}: {e}"))
                body = reply.model_dump_json().encode()
            if msg.reply:
                await msg.respond(body)

        sub = await self.nc.subscribe(subject, queue=queue, cb=answer if inline else spawn)
        self._subs.append(sub)
        return sub

    async def serve_raw(self, subject: str, handler: Callable[[bytes], Awaitable[bytes]]) -> Any:
        async def cb(msg: Msg) -> None:
            out = await handler(msg.data)
            if msg.reply:
                await msg.respond(out)

        sub = await self.nc.subscribe(self._full(subject), cb=cb)
        self._subs.append(sub)
        return sub
