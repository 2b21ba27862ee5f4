"""The transport: one authenticated NATS connection, the JetStream stream of durable events, and what the
other seams share (`Link`: the connection, its subject prefix and source, its subscriptions and tasks, its reply
`Inbox`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.transport import TcpTransport
from nats.js.api import RetentionPolicy, StreamConfig
from nats.js.errors import NotFoundError

from libs.common import security
from libs.common.bus import frames
from libs.common.config import CommonSettings

log = logging.getLogger("holdfast.bus")
_SPACE = re.compile(r"\s")  # str.isspace()'s characters, every one of them (tests/common/test_bus_frames.py)

# Subject heads kept in the stream (durable events); the rest (commands, health, core events) is not stored.
STREAM_KINDS = ("fault", "incident", "intent", "memory", "engine", "router", "node.gpu")


def nats_auth(settings: CommonSettings, source: str) -> dict[str, Any]:
    """nats.connect's options for this connection's identity: TLS against the cluster's CA, the identity's nkey
    (its seed is read by nats-py only to sign the server's nonce) and its own inbox prefix (the server lets it
    read replies there only). `insecure`: none of it, for a server with auth off."""
    if settings.insecure:
        return {}
    creds = security.credentials_for(settings.credentials(), source, settings.node)
    return {"tls": creds.client_tls(), "nkeys_seed": str(creds.nkey_seed),
            "inbox_prefix": security.policy.inbox_prefix(creds.identity)}


class JoinedWrites(TcpTransport):
    """nats-py's TCP transport, handing each flush of pending commands to asyncio as one buffer, and never waiting
    long for a close.

    nats-py flushes its pending commands with `writelines(list)`. Over plain TCP asyncio joins the list into one
    send; over TLS (`start_tls`'s transport) it encrypts each element as a TLS record of its own: one record per
    publish, each with its own AES-GCM pass and Python calls here, and each read, decrypted and parsed by
    nats-server on its own (Go's tls.Conn returns one record a Read). Joined, a flush of hundreds of publishes is a
    few 16 KiB records (docs/security.md, "What it costs"). The bytes on the wire are the same commands.

    A TLS handshake that fails (the server resets it: its TLS timeout passed on a loaded host) leaves nats-py
    holding the plain stream whose socket `start_tls` took over and closed: that stream is never told, so
    nats-py's wait for its close, before it tries again, never ended and `connect` hung for good (nats.py
    issues 382 and 718; a clean-clone run of 2026-12-07 lost a test's stack start to it). The wait is bounded."""

    def writelines(self, payload: list[bytes]) -> None:  # type: ignore[override]
        self.write(b"".join(payload))

    @classmethod
    def take_over(cls, transport: Any) -> Any:
        """`transport` (nats-py's, just connected) as one of ours: the same streams. nats-py makes its transport on
        the first connect (an unconnected one counts as none) and keeps it for every reconnect, each of which
        gives it new streams: so ours, once in place, stays. A websocket transport is left as it is."""
        if type(transport) is not TcpTransport:
            return transport
        ours = cls()
        ours.__dict__.update(transport.__dict__)
        return ours

    async def wait_closed(self) -> None:
        try:
            await asyncio.wait_for(super().wait_closed(), CLOSE_WAIT_S)
        except TimeoutError:
            log.debug("nats transport: no close seen in %.1f s; going on", CLOSE_WAIT_S)


CLOSE_WAIT_S = 1.0


class Connection(security.RenewingNATS):
    """nats-py's client (its TLS built from the credentials' files: security/renewal.py) whose bus-owned
    subscriptions may be handled inline.

    nats-py hands each message of a subscription to a queue read by a task of the subscription's own, which awaits
    the callback: a put, a get, a task switch and a coroutine per message. The link's reply inbox and its pull
    consumers' inboxes get most of a service's messages (every stream ack, command reply and fetched event), and
    their handlers only file the message and wake a waiter: those run here, as the message is parsed, in the
    order the server sent them (docs/bus.md, "Costs"). An inline handler never waits and never raises (a raise is
    logged; the read loop goes on)."""

    def __init__(self, creds: security.Credentials | None) -> None:
        super().__init__(creds)
        self.inline: dict[int, Callable[[Msg], None]] = {}  # by subscription id
        self.on_reconnect: list[Callable[[], None]] = []  # called once connected again (durable.py: ask again)

    async def _process_pong(self) -> None:
        # nats-py's flush cancels its PING's future when the PONG is late and leaves it queued: the late PONG's
        # set_result raised InvalidStateError inside the read loop, which ended it for good (no reconnect: every
        # later publish and request timed out; a controller's bus PING during a 7 s server stall, probe of
        # 2026-12-07). A PONG answers the oldest PING; one nobody waits for any more is dropped.
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0

    async def _connect_to_server(self, s: Any) -> None:
        # TCP connected, before the TLS handshake and the CONNECT: ours from here on (JoinedWrites.take_over)
        await super()._connect_to_server(s)
        self._transport = JoinedWrites.take_over(self._transport)

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        handler = self.inline.get(sid)
        sub = self._subs.get(sid)
        if handler is None or sub is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        sub._received += 1
        msg = self._build_message(sid, subject, reply, data, await self._process_headers(headers))
        try:
            handler(msg)
        except Exception:  # noqa: BLE001 - a handler's bug must not end the connection's read loop
            log.exception("inline handler of %s failed", msg.subject)

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        """nats-py's parse of a message's header lines, the same result for every input, without its scan of
        each name character by character in Python (`any(c.isspace() for c in key)`: ~1 us of ~2.7 a message
        with two headers; every stream message and command reply has them)."""
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if not sep:
                continue  # an empty line too
            try:
                key = name.strip().decode("ascii")
            except UnicodeDecodeError:
                continue
            if _SPACE.search(key):
                continue
            out[key] = value.strip().decode("utf-8", "replace")
        return out


NATS_ERROR_EVERY_S = 30.0


async def server_answers(nc: NATS, within_s: float) -> bool:
    """Whether `nc`'s server answers a PING within `within_s` over a connection that is up: nats-py says "connected"
    through a stalled server (SIGSTOP, a frozen host), and its flush returns at once, PONG or not, while its read
    loop is down for a reconnect."""
    if not nc.is_connected:
        return False
    try:
        await nc.flush(timeout=within_s)  # type: ignore[arg-type]  # a float works: nats-py's wait_for takes it
    except Exception:  # noqa: BLE001 - no PONG in time, or the connection went meanwhile
        return False
    return bool(nc.is_connected)


async def open_connection(settings: CommonSettings, source: str) -> NATS:
    # TLS built from the credentials' files at each (re)connect that finds them rotated (security/renewal.py).
    nc = Connection(None if settings.insecure else
                    security.credentials_for(settings.credentials(), source, settings.node))

    said: dict[str, float] = {}  # each error's text -> when it was last logged

    async def error_cb(e: Exception) -> None:
        # while the server is down nats-py reports each failed reconnect, five a second per connection: one line
        # per distinct error every NATS_ERROR_EVERY_S is what an operator can read (an outage of minutes was
        # thousands of identical lines in every service's log, probe of 2026-12-07)
        text, now = str(e) or type(e).__name__, time.monotonic()
        if now - said.get(text, -NATS_ERROR_EVERY_S) >= NATS_ERROR_EVERY_S:
            said[text] = now
            log.warning("nats error: %s (the same one is logged again at most every %.0f s)", text,
                        NATS_ERROR_EVERY_S)

    async def disconnected_cb() -> None:
        if not (nc.is_closed or nc.is_draining):  # a close we asked for is not news
            log.warning("nats disconnected; reconnecting")

    async def reconnected_cb() -> None:
        log.info("nats reconnected")
        for call in list(nc.on_reconnect):
            call()

    await nc.connect(
        servers=[s.strip() for s in settings.nats_url.split(",")],
        name=source,
        **nats_auth(settings, source),
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,  # type: ignore[arg-type]  # nats-py sleeps this long: a float works
        connect_timeout=2,
    )
    return nc


class Inbox:
    """One inbox subscription for every reply this connection waits on (publish_all's stream acks, request_all's
    command replies), each routed by its token, handed out by one counter, to `on_reply(arg, msg)`: not a
    subscription, a task and a timer per reply (nats-py's request and publish_async; docs/bus.md has the cost)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.prefix: str | None = None
        self._tokens = itertools.count()
        self._waiting: dict[str, tuple[Callable[[Any, Msg], None], Any]] = {}

    async def open(self) -> str:
        """The subject prefix to reply to (`prefix + token`), subscribed on first use."""
        if self.prefix is not None:
            return self.prefix
        prefix = self.link.subjects.check(f"{self.link.nc.new_inbox()}.")  # replies: this prefix and digits

        def on_message(msg: Msg) -> None:
            waiting = self._waiting.pop(msg.subject[len(prefix):], None)
            if waiting is not None:
                waiting[0](waiting[1], msg)

        sub = await self.link.subscribe_inline(prefix + "*", on_message)
        if self.prefix is not None:  # another caller opened it while we subscribed: keep one
            await sub.unsubscribe()
            return self.prefix
        self.link.subs.append(sub)
        self.prefix = prefix
        return prefix

    def expect(self, on_reply: Callable[[Any, Msg], None], arg: Any) -> str:
        token = str(next(self._tokens))
        self._waiting[token] = (on_reply, arg)
        return token

    def forget(self, token: str) -> None:
        self._waiting.pop(token, None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)


class Link:
    """One connection and what every seam of the bus shares over it. Invariant: every subscription and task
    started through it is in `subs`/`tasks`, so `close` ends them all."""

    def __init__(self, nc: NATS, settings: CommonSettings, source: str) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.prefix = settings.subject_prefix
        self.source = source
        self.rejected = 0  # malformed or refused messages dropped (health replies and tests show it)
        self.subs: list[Any] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.inbox = Inbox(self)
        self.subjects = frames.Subjects()  # the subjects the hot path sends to, checked once each
        self.fast = frames.supported(nc)  # frames queued by the bus itself (frames.py), else by nats-py's publish

    async def subscribe_inline(self, subject: str, handler: Callable[[Msg], None]) -> Any:
        """A subscription whose `handler` runs as each message is parsed (`Connection`), not in a task of its own.
        For a subject on which messages come only in answer to requests sent after this returns (a reply inbox, a
        pull consumer's inbox): before it returns the handler is inline, so every message goes that one way, in
        order. On a client that is not a `Connection`: the same handler through nats-py's queue."""
        async def queued(msg: Msg) -> None:
            handler(msg)

        sub = await self.nc.subscribe(subject, cb=queued)
        inline = getattr(self.nc, "inline", None)
        if inline is not None:
            inline[sub._id] = handler
        return sub

    async def unsubscribe(self, sub: Any) -> None:
        """Undo `subscribe_inline` (or nats-py's `subscribe`)."""
        inline = getattr(self.nc, "inline", None)
        if inline is not None:
            inline.pop(sub._id, None)
        await sub.unsubscribe()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A task kept referenced until it ends (and cancelled by `close`)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def ensure_stream(self) -> None:
        """Create (or keep) the stream that holds every durable event subject, with `stream_replicas` copies
        (on a NATS cluster: the stream outlives a server, its consumers' state too, as they inherit them). Only the
        control plane and operators may (security/policy.py `manages_stream`): any other service only looks, and
        one that starts before the stream exists says so and goes on; its events are retried until it does
        (emit_until_stored, the gpu_manager's mirror queue)."""
        if not security.manages_stream(security.identity_for(self.source, self.settings.node)):
            try:
                await self.js.stream_info(self.settings.stream_name)
            except NotFoundError:
                log.warning("stream %s does not exist yet: the control plane creates it (events are retried until "
                            "then)", self.settings.stream_name)
            return
        config = StreamConfig(
            name=self.settings.stream_name,
            subjects=[f"{self.prefix}.{kind}.>" for kind in STREAM_KINDS],
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
        for task in list(self.tasks):
            if task.get_name().startswith(("pull:", "in-progress:")):
                task.cancel()
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=2)
        except Exception:  # noqa: BLE001 - closing is best effort; the server may already be gone
            pass
        if not self.nc.is_closed:
            await self.nc.close()
