"""Durable consumers: JetStream pull consumers with explicit ack, read by pull requests on a callback inbox.

A consumer asks JetStream (`$JS.API.CONSUMER.MSG.NEXT`) for as many messages as it has free slots
(`concurrency`); the server sends what it has at once and the rest as it comes, until the request is filled or
expires (`FETCH_WAIT_S`), then the consumer asks again. Messages land on one callback subscription and are handed
over at the end of the event-loop pass they land in, unless the rest of the same answer is on its way (the server
said it has more for this consumer): then the whole answer goes as one batch (held `HOLD_S` at most). Not
nats-py's `fetch`: it takes each message with `next_msg`, a task and a timer per message, ~2x the CPU per message
of this (docs/bus.md, `holdfast bench controlplane --floor`). Invariants
(libs/common README 3): a message is acked only after its handler succeeded; a failed handler's message is nak'd and
comes again: after a temporary failure (`errors.temporary`: etcd or NATS unreachable, leadership in doubt) for as long
as the outage lasts, later and later (`retry_after`); after any other, at most `MAX_DELIVER` deliveries, then it is
terminated (a poison message); a malformed message is terminated (never redelivered); a refused one
(receive.py) is acked, never acted on; at most `concurrency` messages are unacked at once (`max_ack_pending`, and
no request asks for more than the free slots), each marked in progress while its handler runs, so slow work is not
redelivered under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NoStreamResponseError, NotFoundError

from libs.common.bus import frames
from libs.common.bus.connection import Link
from libs.common.bus.receive import EventHandler, Vet, decode, event_callback, refused
from libs.common.errors import HoldfastError, MalformedMessage, count_as_temporary, temporary
from libs.common.events import Envelope, subscription_subject

log = logging.getLogger("holdfast.bus")

MAX_DELIVER = 5  # deliveries of a message whose handler keeps failing other than temporarily: then terminated
# The server's own bound, for a message that is never settled (its consumer's process dies on it each time): far
# more than MAX_DELIVER, so that a temporary failure (an etcd stalled for minutes) is retried, not dropped. With
# `retry_after`'s delays, 100 deliveries span over 8 minutes.
MAX_DELIVER_SERVER = 100
RETRY_FIRST_S = 0.5  # a failed message comes again after this, then twice as late each time (temporary failures)
RETRY_MAX_S = 5.0
NO_CONSUMER = ("503", "404")  # a pull request's answer when the server has no such durable (or stream)
# NATS unreachable or without its stream for a moment: a handler that published (an intent, a route) failed by it.
count_as_temporary(nats.errors.ConnectionClosedError, nats.errors.NoRespondersError, NoStreamResponseError)
FETCH_WAIT_S = 5.0  # how long one fetch waits for a first message before asking again
# The longest a landed message waits for the rest of its request's answer. An answer of a few hundred messages
# lands over several loop passes (one socket read each); handed over pass by pass, its pieces finished, and were
# asked for again, at different times, so a busy consumer's slots stayed split into ever smaller batches: 2x the
# batches, flushes and etcd transactions per incident (docs/controlplane.md, "Batches split by loop passes").
HOLD_S = 0.05
# Many events at once -> for each, in order: None (handled) or the exception that failed it.
BatchHandler = Callable[[list[Envelope]], Awaitable[list[BaseException | None]]]

# Inside a durable handler: how many times JetStream has delivered this message (1: the first time). A
# handler whose progress is recorded elsewhere reads that record only on a redelivery.
delivery_attempt: contextvars.ContextVar[int] = contextvars.ContextVar("hf_delivery_attempt", default=0)
# Inside a `durable_batches` handler: each event's delivery count, in the order of the events handed over
# (empty outside one). Read it at the handler's start: the handler's own tasks copy it as it is then.
delivery_attempts: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar("hf_delivery_attempts",
                                                                                      default=())


def consumer_config(name: str, new_only: bool, ack_wait: float, concurrency: int) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=name,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.NEW if new_only else DeliverPolicy.ALL,
        max_deliver=MAX_DELIVER_SERVER,  # MAX_DELIVER is applied here, by failure (`retry_after`)
        ack_wait=ack_wait,
        max_ack_pending=concurrency,  # never more out than we run: a waiting message gets no in-progress mark
    )


def num_delivered(msg: Msg) -> int:
    """How many times JetStream has delivered `msg`, read from its ack subject; `msg.metadata.num_delivered` only
    for a form not known here. `msg.metadata` also parses the timestamp into a datetime and builds two dataclasses:
    7.1 us a message against 0.4 (docs/bus.md)."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(tokens[4]) or 1
    if len(tokens) >= 11:  # $JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>...
        return int(tokens[6]) or 1
    return msg.metadata.num_delivered or 1


def num_pending(msg: Msg) -> int:
    """How many messages the stream still holds for this consumer after `msg`, read from its ack subject."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9:
        return int(tokens[8])
    if len(tokens) >= 11:
        return int(tokens[10])
    return msg.metadata.num_pending or 0


async def beside(together: Awaitable[None], alone: dict[int, Awaitable[None]],
                 out: list[BaseException | None]) -> list[BaseException | None]:
    """For batch handlers: the batch's common part and the events handled one at a time (by position) run
    concurrently; each one-at-a-time handler's failure becomes its event's outcome in `out`, and a failure of
    the common part is raised (failing every event of the batch)."""
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


def retry_after(delivered: int, is_temporary: bool) -> float | None:
    """When a message whose handler failed comes again (seconds), or None: terminated. A temporary failure is
    retried however often it recurs, later each time (an outage costs a delivery every RETRY_MAX_S, not the
    message); any other, until its MAX_DELIVER-th delivery."""
    if is_temporary:
        return min(RETRY_FIRST_S * 2 ** min(max(delivered - 1, 0), 16), RETRY_MAX_S)
    return RETRY_FIRST_S if delivered < MAX_DELIVER else None


async def settle(msg: Msg, error: BaseException | None) -> None:
    try:
        if error is None:
            await msg.ack()
        elif isinstance(error, MalformedMessage):
            await msg.term()  # poison: never redeliver
        else:
            delivered, is_temporary = num_delivered(msg), temporary(error)
            delay = retry_after(delivered, is_temporary)
            if delay is None:
                log.error("handler of %s failed on delivery %d; giving the message up", msg.subject, delivered,
                          exc_info=error)
                await msg.term()
            elif is_temporary:
                log.warning("handler of %s failed (%r); delivery %d comes again in %.1f s", msg.subject, error,
                            delivered + 1, delay)
                await msg.nak(delay=delay)
            else:
                log.error("handler of %s failed; message will be redelivered", msg.subject, exc_info=error)
                await msg.nak(delay=delay)
    except Exception:  # noqa: BLE001 - ack/nak failed (connection lost): JetStream redelivers
        log.warning("could not settle a message on %s", msg.subject)


async def settle_all(link: Link, msgs: list[Msg], outcomes: list[BaseException | None]) -> None:
    """Each message settled as `settle` does; the acks queued as frames (frames.py: an empty message to the ack
    subject, which is what `msg.ack()` sends), without nats-py's per-publish checks. The ack subject is the reply
    subject of a message the server sent, one token of its MSG line: no whitespace can be in it."""
    nc, fast = link.nc, link.fast
    for msg, error in zip(msgs, outcomes, strict=True):
        if error is not None or not fast or not msg.reply:
            await settle(msg, error)
            continue
        try:
            await frames.send(nc, msg.reply, b"", "", b"", fast=True)
            msg._ackd = True
        except Exception:  # noqa: BLE001 - not sent (connection lost): JetStream redelivers
            log.warning("could not settle a message on %s", msg.subject)


class Consumer:
    """One durable's pull requests, its message inbox and its in-progress ticker; `unsubscribe` ends them (the
    durable stays on the server). Invariant: `asked` (messages the open pull request may still bring) <= `free`
    when a request is sent, and one request is open at a time, so no more than `concurrency` messages are ever
    handed over unsettled."""

    def __init__(self, link: Link, name: str, concurrency: int, ack_wait: float) -> None:
        self.link, self.name = link, name
        self.free = concurrency
        self.room = asyncio.Event()
        self.running: dict[int, tuple[Msg, float]] = {}  # id(msg) -> (msg, when its handler started)
        self.ack_wait = ack_wait
        self.asked = 0  # messages the open pull request may still bring
        self.answered = asyncio.Event()  # the open request is filled, expired or refused
        self.status: str | None = None  # how the server ended the last request, if it did (408, 409...)
        self.arrived: list[Msg] = []  # landed, not yet handed over
        self.due = False  # a hand-over is scheduled for the end of this loop pass
        self.coming = False  # the last message landed said the server has more for this consumer
        self.hold_until = 0.0  # the first of `arrived` waits no longer than this for the rest of its answer
        self.timer: asyncio.TimerHandle | None = None
        self.sub: Any = None
        self.tasks: list[asyncio.Task[None]] = []
        self.config: ConsumerConfig | None = None
        self.remade = 0  # times the durable (and the stream) were found gone and made again

    async def start(self, subject: str, config: ConsumerConfig, dispatch: Callable[[list[Msg]], None]) -> Consumer:
        link = self.link
        stream = link.settings.stream_name
        config.filter_subject = subscription_subject(link.prefix, subject)
        config.name = self.name
        self.config = config
        await self._make(config)
        inbox = link.nc.new_inbox()
        self.sub = await link.subscribe_inline(inbox, self._landed(dispatch))
        hooks = getattr(link.nc, "on_reconnect", None)
        if hooks is not None:
            hooks.append(self._ask_again)
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{self.name}"
        self.tasks = [link.spawn(self._pull(next_subject, inbox), f"pull:{self.name}"),
                      link.spawn(self._keep_in_progress(), f"in-progress:{self.name}")]
        return self

    async def _make(self, config: ConsumerConfig) -> None:
        """The durable on the server as `config` says: made if missing, its slots and deliveries updated."""
        link = self.link
        stream = link.settings.stream_name
        try:
            info = await link.js.consumer_info(stream, self.name)
            if (info.config.max_ack_pending, info.config.max_deliver) != (config.max_ack_pending, config.max_deliver):
                # Made by an earlier version with other slots or deliveries: updated in place (editable fields), or
                # the new ones would never apply to a durable that already exists.
                try:
                    await link.js.add_consumer(stream, config=config)
                except Exception as e:  # noqa: BLE001 - refused (another field differs): consumed as it is
                    log.warning("durable %s keeps %d slots, not %d: %s", self.name, info.config.max_ack_pending,
                                config.max_ack_pending, e)
        except NotFoundError:
            await link.js.add_consumer(stream, config=config)

    async def _make_again(self) -> None:
        """A pull request answered 503 (no responders: the server knows no such durable): the server lost it, with
        its stream (one that came back on an empty store: a lost volume), or it was deleted. The stream and the
        durable are made again, or nothing would ever be consumed again; the events stored before are gone with
        them (their publishers' own retries, and the level-triggered passes, are what recovers them)."""
        assert self.config is not None
        try:
            await self.link.ensure_stream()
            await self._make(self.config)
        except Exception as e:  # noqa: BLE001 - the server busy or going away again: tried on the next refusal
            log.warning("durable %s not made again yet: %r", self.name, e)
            return
        self.remade += 1
        log.warning("durable %s was gone from the server: made again (with its stream if it was gone too)", self.name)

    def _ask_again(self) -> None:
        """Connected again (to another server of a cluster, maybe): the open pull request may have died with the
        old connection, and waiting for its expiry would hold every event FETCH_WAIT_S + 1 s; ask again now (the
        server's max_ack_pending still bounds what two open requests can bring)."""
        self.status = None
        self.answered.set()

    async def unsubscribe(self) -> None:
        hooks = getattr(self.link.nc, "on_reconnect", None)
        if hooks is not None and self._ask_again in hooks:
            hooks.remove(self._ask_again)
        for task in self.tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.link.unsubscribe(self.sub)

    def done(self, msg: Msg) -> None:
        self.running.pop(id(msg), None)
        self.free += 1
        self.room.set()

    def _landed(self, dispatch: Callable[[list[Msg]], None]) -> Callable[[Msg], None]:
        loop = asyncio.get_running_loop()

        def hand_over() -> None:  # at the end of a loop pass: what landed goes to `dispatch` as one batch
            self.due = False
            if not self.arrived:
                return
            if self.asked > 0 and self.coming and loop.time() < self.hold_until:
                # The rest of the request's answer is on its way (the server has more for this consumer): the
                # whole answer goes as one batch, not split by the loop passes it lands in.
                if self.timer is None:
                    self.timer = loop.call_at(self.hold_until, hand_over)
                return
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            msgs, self.arrived = self.arrived, []
            now = loop.time()
            for msg in msgs:
                self.running[id(msg)] = (msg, now)
            dispatch(msgs)

        def landed(msg: Msg) -> None:  # inline (Link.subscribe_inline): bookkeeping only, no wait
            headers = msg.headers
            if headers and "Status" in headers:  # 408: expired; 409: refused (a limit, the consumer gone)
                if headers["Status"] != "100":  # 100: an idle heartbeat, the request is still open
                    self.status = headers["Status"]
                    self.answered.set()
                    self.coming = False
                    if self.arrived and not self.due:
                        self.due = True
                        loop.call_soon(hand_over)
                return
            self.free -= 1
            self.asked -= 1
            if self.asked <= 0:
                self.answered.set()
            self.coming = num_pending(msg) > 0
            if not self.arrived:
                self.hold_until = loop.time() + HOLD_S
            self.arrived.append(msg)
            if not self.due:
                self.due = True
                loop.call_soon(hand_over)

        return landed

    async def _pull(self, next_subject: str, inbox: str) -> None:
        expires = int(FETCH_WAIT_S * 1e9)
        while True:
            while self.free <= 0:
                self.room.clear()
                await self.room.wait()
            self.asked = self.free
            self.answered.clear()
            self.status = None
            try:
                await self.link.nc.publish(next_subject, json.dumps({"batch": self.asked, "expires": expires}).encode(),
                                           reply=inbox)
            except Exception as e:  # noqa: BLE001 - a reconnect: ask again shortly
                log.warning("pull request on %s failed: %s", self.name, e)
                await asyncio.sleep(0.2)
                continue
            # The server ends the request itself (filled, or a 408 at `expires`); a request lost with the
            # connection is given up a second after it would have expired.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.answered.wait(), FETCH_WAIT_S + 1)
            if self.status in NO_CONSUMER:
                log.warning("pull request on %s refused: status %s (no such durable on the server)", self.name,
                            self.status)
                await self._make_again()
                await asyncio.sleep(0.2)
            elif self.status not in (None, "408"):  # refused (a limit, the consumer deleted): not in a hot loop
                log.warning("pull request on %s refused: status %s", self.name, self.status)
                await asyncio.sleep(0.2)

    async def _keep_in_progress(self) -> None:
        """One ticker for all running messages (not a timer each). Period ack_wait/4 and age >= ack_wait/4:
        every message is marked before it is ack_wait/2 old, then every ack_wait/4, well inside ack_wait."""
        loop = asyncio.get_running_loop()
        period = max(self.ack_wait / 4, 0.05)
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for msg, started in list(self.running.values()):
                if now - started >= period:
                    with contextlib.suppress(Exception):
                        await msg.in_progress()


async def durable(link: Link, subject: str, name: str, handler: EventHandler, *, new_only: bool = False,
                  concurrency: int = 1, ack_wait: float = 30, attach_trace: bool = True,
                  vet: Vet | None = None) -> Consumer:
    """Each message to its own `handler` call (a task each; at most `concurrency` at once)."""
    inner = event_callback(link, handler, raise_errors=True, attach_trace=attach_trace, vet=vet)
    consumer = Consumer(link, name, concurrency, ack_wait)

    async def run(msg: Msg) -> None:
        error: BaseException | None = None
        try:
            delivery_attempt.set(num_delivered(msg))
            await inner(msg)
        except Exception as e:  # noqa: BLE001 - terminated (malformed) or redelivered (failed)
            error = e
        await settle(msg, error)
        consumer.done(msg)

    def dispatch(msgs: list[Msg]) -> None:
        for msg in msgs:
            link.spawn(run(msg), f"durable:{name}")

    return await consumer.start(subject, consumer_config(name, new_only, ack_wait, concurrency), dispatch)


async def durable_batches(link: Link, subject: str, name: str, handler: BatchHandler, *, concurrency: int = 256,
                          ack_wait: float = 30, new_only: bool = False, vet: Vet | None = None) -> Consumer:
    """Each fetched batch to one `handler` call (one task for them all)."""
    consumer = Consumer(link, name, concurrency, ack_wait)

    async def run(msgs: list[Msg]) -> None:
        envs: list[Envelope] = []
        handed: list[Msg] = []
        attempts: list[int] = []
        try:
            for msg in msgs:
                try:
                    envs.append(decode(link, msg, vet))
                except MalformedMessage as e:
                    refused(link, msg, e)
                    await settle(msg, e)
                    continue
                except HoldfastError as e:
                    refused(link, msg, e)
                    await settle(msg, None)  # acked: never acted on, never redelivered
                    continue
                handed.append(msg)
                attempts.append(num_delivered(msg))
            delivery_attempts.set(tuple(attempts))  # this task's own context: per batch
            try:
                outcomes = await handler(envs) if envs else []
            except Exception as e:  # noqa: BLE001 - every event of the batch is redelivered
                outcomes = [e] * len(envs)
            await settle_all(link, handed, outcomes)
        finally:
            for msg in msgs:
                consumer.done(msg)

    def dispatch(msgs: list[Msg]) -> None:
        link.spawn(run(msgs), f"durable:{name}")

    return await consumer.start(subject, consumer_config(name, new_only, ack_wait, concurrency), dispatch)
