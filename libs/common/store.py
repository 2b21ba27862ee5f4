"""The etcd store behind a thin interface (aetcd underneath; nothing else in the tree imports aetcd).

Keys are given relative to the configured prefix (`/holdfast/` by default): `store.put("nodes/n1", ...)`.
Values are JSON: pass a pydantic model, a dict or bytes. What is offered:
- get / get_prefix / put / delete / delete_prefix; reads are tried again while etcd answers Unavailable (a
  member's leader killed: "leader changed"), writes are not (one may have been applied)
- create (put only if absent) and cas (compare-and-swap on the current value), both transactions
- watch_prefix: an async iterator of `WatchEvent` that survives reconnects by resuming at the next revision
  (a watch given no start revision reads the current one first, so even its first resume has one);
  a start (or resume) at a revision etcd has compacted raises `WatchCompacted` (errors.py) instead: the gap
  cannot be filled from the history, the caller resyncs from a snapshot (`ClusterView.follow` does)
  A cancelled watch always ends, even one cancelled as etcd confirms its creation (`etcd_watch.Watcher`)
- leases: `grant(ttl)` and `KeepAlive` (a supervised task refreshing it at ttl/3); `ThreadKeepAlive` does
  the refreshing from a dedicated thread with its own gRPC channel, so a busy event loop cannot let it lapse
- `LeaderElection`: campaign with a key bound to a lease (kept by `ThreadKeepAlive`), observe, resign
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.utils
import grpc
from aetcd import rpc
from pydantic import BaseModel

from libs.common import security
from libs.common.config import CommonSettings
from libs.common.errors import Unavailable, WatchCompacted, count_as_temporary, count_as_temporary_if
from libs.common.etcd_watch import Watcher

log = logging.getLogger("holdfast.store")
# etcd unreachable, or slow past a call's deadline: a durable event failed by it is retried, not dropped.
count_as_temporary(aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError)
# Nor one failed by an etcd out of space (its NOSPACE alarm: every write refused until an operator compacts,
# defragments and disarms it, minutes later), or too busy: aetcd raises those as a bare ClientError over the status.
_ETCD_TEMPORARY_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
                                   grpc.StatusCode.DEADLINE_EXCEEDED})


def _etcd_refused_for_now(error: BaseException) -> bool:
    cause = error.__cause__ if isinstance(error, aetcd.exceptions.ClientError) else error
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() in _ETCD_TEMPORARY_CODES


count_as_temporary_if(_etcd_refused_for_now)
WATCH_CANCEL_S = 5.0
UNREACHABLE_LOG_S = 5.0  # how often a connect that waits for etcd says so
READ_RETRY_S = 5.0  # longer than an election among the members left (etcd's default election timeout: 1 s)
M = TypeVar("M", bound=BaseModel)

# A member gone takes its connection with it; the channel then tries the members again at once, and at most
# this long apart while none answers (gRPC's default backs off to 120 s, longer than any lease here).
_RECONNECT = {"grpc.initial_reconnect_backoff_ms": 100, "grpc.max_reconnect_backoff_ms": 1000,
              "grpc.min_reconnect_backoff_ms": 100,
              # a page of a snapshot read (cluster_view.py, 2000 keys) may pass gRPC's 4 MiB default: etcd sends any
              # size, and a reply refused here failed every later term's start-up read
              "grpc.max_receive_message_length": 256 << 20}


def encode_value(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json().encode()
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value, separators=(",", ":")).encode()


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: str  # relative to the store prefix
    value: bytes | None
    revision: int


@dataclass
class Lease:
    id: int
    ttl: int


def grpc_target(hosts: list[tuple[str, int]]) -> str:
    """One gRPC target naming every etcd member: `ipv4:a:p,b:q` (gRPC's static address list) when the hosts
    are IP literals, so the channel's pick_first policy connects to the first member that answers and, when
    that one goes, to the next that does (a member's death costs the calls then in flight, not the client).
    A single host name stays a DNS target: gRPC tries every address it resolves to (a Kubernetes headless
    Service names every member). Several host names are refused: gRPC takes one name a channel."""
    hosts = [(h.strip("[]"), p) for h, p in hosts]
    if len(hosts) == 1:
        host, port = hosts[0]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    families = {_ip_family(h) for h, _ in hosts}
    if families == {4}:
        return "ipv4:" + ",".join(f"{h}:{p}" for h, p in hosts)
    if families == {6}:
        return "ipv6:" + ",".join(f"[{h}]:{p}" for h, p in hosts)
    raise ValueError(f"etcd endpoints {hosts}: several members must be IP literals of one family "
                     "(or one DNS name resolving to all of them)")


def channel_options(hosts: list[tuple[str, int]]) -> dict[str, Any]:
    """The channel's options: fast reconnects and, for a list of addresses (whose target has no host name),
    the name every member's certificate is checked against: the first host's (on loopback 127.0.0.1, which
    the server certificate names; in a cluster give one DNS name instead)."""
    if len(hosts) == 1:
        return dict(_RECONNECT)
    return {**_RECONNECT, "grpc.ssl_target_name_override": hosts[0][0].strip("[]")}


def _ip_family(host: str) -> int | None:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


class _EtcdClient(aetcd.Client):
    """aetcd's client over a channel to every member (`grpc_target`) and, with `tls`, presenting a client
    certificate (aetcd itself dials one host in plaintext only): its `connect` with that channel, the rest
    unchanged. With etcd's auth on, the certificate's CN is the user whose role's key ranges every request is
    checked against."""

    channel: Any  # aetcd's (untyped): the channel new calls go over

    def __init__(self, *args: Any, target: str, tls: security.GrpcTls | None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._target = target
        self._tls = tls
        self._retired: list[Any] = []  # channels left by a certificate renewal, closed with the client

    async def connect(self) -> None:
        if self._connected.is_set():
            # Rotated certificate files: the next calls go over a new channel that presents them (gRPC keeps a
            # channel's credentials for good, reconnects included; security/renewal.py).
            fresh = None if self._tls is None else self._tls.renewed()
            if fresh is not None:
                self._open(fresh)
            return
        self._open(None if self._tls is None else self._tls.credentials())
        # Our Watcher: aetcd's, with a creation that a cancellation always reaches (etcd_watch.py).
        self._watcher = Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
        self._connected.set()

    def _open(self, tls: grpc.ChannelCredentials | None) -> None:
        """Stubs over a new channel. On a renewal the old channel stays open: calls under way finish on it, and
        so does the watch stream (etcd does not re-check an established connection); the watcher's next stream,
        after a break, opens on the new one."""
        if self.channel is not None:
            self._retired.append(self.channel)
        options = list(self._options.items())
        self.channel = (rpc.insecure_channel(self._target, options=options) if tls is None
                        else rpc.secure_channel(self._target, tls, options=options))
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        if self._watcher is not None:
            self._watcher._watchstub = rpc.WatchStub(self.channel)

    async def close(self) -> None:
        await super().close()
        retired, self._retired = self._retired, []
        for channel in retired:
            with contextlib.suppress(Exception):
                await channel.close()


def etcd_tls(settings: CommonSettings, source: str) -> security.GrpcTls | None:
    """The channel credentials of the identity of `source` (as the bus's: '<service>:<instance>'; any other
    source is an operator, `admin`), from its files, renewed when they change; None when `insecure`."""
    if settings.insecure:
        return None
    tls = security.GrpcTls(security.credentials_for(settings.credentials(), source, settings.node, nats=False))
    tls.credentials()  # read now: unusable files fail the start, not a later call
    return tls


class Store:
    def __init__(self, client: aetcd.Client, settings: CommonSettings, source: str = "") -> None:
        self.client = client
        self.settings = settings
        self.source = source
        self.prefix = settings.etcd_prefix if settings.etcd_prefix.endswith("/") else settings.etcd_prefix + "/"

    @classmethod
    async def connect(cls, settings: CommonSettings, *, source: str = "", timeout: float | None = 10.0) -> Store:
        """`source`: who connects ('<service>:<instance>', as for `Bus.connect`); it picks the credentials.
        `timeout` None: until etcd answers, however long (a service's start: as its NATS connection waits for a
        server, it waits out an etcd that is stalled or restarting rather than exiting; said every
        UNREACHABLE_LOG_S in its log)."""
        target = grpc_target(settings.etcd_hosts())
        client = _EtcdClient(timeout=5, target=target, tls=etcd_tls(settings, source),
                             options=channel_options(settings.etcd_hosts()))
        store = cls(client, settings, source)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        said = t0
        while True:
            try:
                await client.status()  # needs no key permission: the router may read endpoints/ only
                if said > t0:
                    log.info("etcd at %s answers after %.1f s", target, loop.time() - t0)
                return store
            except Exception as e:  # noqa: BLE001 - etcd may still be starting
                now = loop.time()
                if timeout is not None and now - t0 > timeout:
                    raise Unavailable(f"etcd at {target} unreachable: {e}") from None
                if timeout is None and now - said >= UNREACHABLE_LOG_S:
                    said = now
                    log.warning("etcd at %s unreachable for %.0f s (%s): still trying", target, now - t0, e)
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.close()

    def full(self, key: str) -> bytes:
        return (self.prefix + key.lstrip("/")).encode()

    def rel(self, key: bytes) -> str:
        return key.decode().removeprefix(self.prefix)

    # ------------------------------------------------------------ key/value

    async def _read(self, call: Any, *args: Any) -> Any:
        """A read, tried again while etcd answers Unavailable (`ConnectionFailedError`: "leader changed" when
        the member's leader died while the read waited on it, or no member reachable) for up to READ_RETRY_S.
        Only reads: a linearizable read is safe to repeat, while a write that got "leader changed" may have
        been applied (repeating it could apply it twice), so writes report the error to their caller."""
        deadline = time.monotonic() + READ_RETRY_S
        while True:
            try:
                return await call(*args)
            except aetcd.exceptions.ConnectionFailedError as e:
                if time.monotonic() > deadline:
                    raise
                log.info("etcd read failed (%s): trying again", e)
                await asyncio.sleep(0.1)

    async def answers(self, within_s: float) -> bool:
        """Whether etcd answers one read within `within_s` (once: no retries, no log line)."""
        try:
            await asyncio.wait_for(self.client.get(self.full("leader/")), within_s)
            return True
        except Exception:  # noqa: BLE001 - unreachable, stalled or refusing: not answering
            return False

    async def get(self, key: str) -> bytes | None:
        r = await self._read(self.client.get, self.full(key))
        return None if r is None else r.value

    async def get_model(self, key: str, model: type[M]) -> M | None:
        raw = await self.get(key)
        return None if raw is None else model.model_validate_json(raw)

    async def get_with_revision(self, key: str) -> tuple[bytes | None, int]:
        r = await self._read(self.client.get, self.full(key))
        return (None, 0) if r is None else (r.value, r.mod_revision)

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        r = await self._read(self.client.get_prefix, self.full(prefix))
        return {self.rel(kv.key): kv.value for kv in r}

    async def get_prefix_with_revisions(self, prefix: str) -> dict[str, tuple[bytes, int]]:
        """Each key under `prefix` with its value and mod revision (when it was last written)."""
        r = await self._read(self.client.get_prefix, self.full(prefix))
        return {self.rel(kv.key): (kv.value, kv.mod_revision) for kv in r}

    async def put(self, key: str, value: Any, *, lease: Lease | None = None) -> None:
        await self.client.put(self.full(key), encode_value(value), lease=lease.id if lease else None)

    async def delete(self, key: str) -> bool:
        r = await self.client.delete(self.full(key))
        return bool(r and r.deleted)

    async def delete_prefix(self, prefix: str) -> int:
        r = await self.client.delete_prefix(self.full(prefix))
        return int(r.deleted) if r else 0

    async def create(self, key: str, value: Any, *, lease: Lease | None = None) -> bool:
        """Put `value` only if `key` does not exist. True when this call created it."""
        k = self.full(key)
        t = self.client.transactions
        ok, _ = await self.client.transaction(
            compare=[t.version(k) == 0],
            success=[t.put(k, encode_value(value), lease.id if lease else None)],
            failure=[],
        )
        return bool(ok)

    async def cas(self, key: str, expected: Any | None, value: Any, *, lease: Lease | None = None) -> bool:
        """Put `value` only if the current value equals `expected` (None: key absent)."""
        if expected is None:
            return await self.create(key, value, lease=lease)
        k = self.full(key)
        t = self.client.transactions
        ok, _ = await self.client.transaction(
            compare=[t.value(k) == encode_value(expected)],
            success=[t.put(k, encode_value(value), lease.id if lease else None)],
            failure=[],
        )
        return bool(ok)

    async def cas_revision(self, key: str, mod_revision: int, value: Any) -> bool:
        """Put `value` only if the key was not modified since `mod_revision` (0: key absent)."""
        k = self.full(key)
        t = self.client.transactions
        cmp = t.version(k) == 0 if mod_revision == 0 else t.mod(k) == mod_revision
        ok, _ = await self.client.transaction(compare=[cmp], success=[t.put(k, encode_value(value))], failure=[])
        return bool(ok)

    # ------------------------------------------------------------ watch

    async def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        """Yield every change under `prefix` from `start_revision` (None: from the revision current when the
        iteration starts, read then); on a broken stream, resume after the last revision seen.

        Invariant: the watch always asks etcd for an explicit revision, the one after the last it has seen (or
        after the read it started at), never "from now": a stream that breaks before its first event, or between
        two, resumes without a gap (a resume from now would lose every change made while it was cut off).
        Raises `WatchCompacted` when the revision to start or resume at is older than etcd's compaction: the
        changes in between are gone for good, and retrying the same revision would fail forever."""
        next_rev = start_revision
        while True:
            try:
                if next_rev is None:  # the watch starts here: after the revision etcd is at now
                    next_rev = await self.revision(prefix) + 1
                watch = await self.client.watch_prefix(self.full(prefix), start_revision=next_rev)
                try:
                    async for ev in watch:
                        rev = ev.kv.mod_revision
                        next_rev = rev + 1
                        kind = "put" if ev.kind == "PUT" else "delete"
                        yield WatchEvent(kind, self.rel(ev.kv.key), ev.kv.value if kind == "put" else None, rev)
                finally:
                    # Bounded: the cancel is a request on the watch stream; a stream that no longer answers (its
                    # member killed) held a cancelled watcher here for good, and whoever awaited it with it.
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation of this task.
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(WATCH_CANCEL_S):
                            await watch.cancel()
            except asyncio.CancelledError:
                raise
            except aetcd.exceptions.RevisionCompactedError as e:
                raise WatchCompacted(prefix, next_rev, int(e.compacted_revision)) from None
            except Exception as e:  # noqa: BLE001 - etcd restarted or the stream broke: resume
                log.warning("watch on %s broke (%s); resuming at revision %s", prefix, e, next_rev)
                await asyncio.sleep(0.5)

    async def revision(self, prefix: str = "") -> int:
        """etcd's current revision, read on `prefix` (a range the caller may read: the router may read
        endpoints/ only); count_only, so no key comes back however many there are."""
        full = self.full(prefix)
        req = rpc.RangeRequest(key=full, range_end=aetcd.utils.prefix_range_end(full), count_only=True)
        await self.client.connect()
        reply = await self.client.kvstub.Range(req, timeout=self.client._timeout, metadata=self.client.metadata)
        return int(reply.header.revision)

    async def delete_if(self, key: str, expected: Any) -> bool:
        """Delete `key` only while its value equals `expected`."""
        k = self.full(key)
        t = self.client.transactions
        ok, _ = await self.client.transaction(compare=[t.value(k) == encode_value(expected)], success=[t.delete(k)], failure=[])
        return bool(ok)

    # ------------------------------------------------------------ leases

    async def grant(self, ttl: int) -> Lease:
        lease = await self.client.lease(ttl)
        return Lease(id=lease.id, ttl=ttl)

    async def refresh(self, lease: Lease) -> bool:
        """Keep the lease alive once. False when etcd says it has expired."""
        reply = await self.client.refresh_lease(lease.id)
        return bool(reply is not None and reply.TTL > 0)

    async def revoke(self, lease: Lease) -> None:
        with contextlib.suppress(Exception):
            await self.client.revoke_lease(lease.id)


class KeepAlive:
    """Refresh an etcd lease every ttl/3 until stopped; `lost` is set when the lease expired anyway."""

    def __init__(self, store: Store, lease: Lease) -> None:
        self.store = store
        self.lease = lease
        self.lost = asyncio.Event()

    async def run(self) -> None:
        interval = max(self.lease.ttl / 3.0, 0.2)
        while True:
            await asyncio.sleep(interval)
            try:
                if not await self.store.refresh(self.lease):
                    log.error("etcd lease %x expired", self.lease.id)
                    self.lost.set()
                    return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - etcd briefly unreachable: try again next tick
                log.warning("lease keep-alive failed: %s", e)


def lease_clock() -> float:
    """Seconds on a clock that runs on while this process is stopped and while the machine sleeps (Linux's
    CLOCK_BOOTTIME; elsewhere the monotonic clock): a lease's ttl runs on in etcd through both."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


class ThreadKeepAlive:
    """Refresh an etcd lease every ttl/3 from a dedicated thread (own synchronous gRPC channel).

    Why a thread: a leader whose event loop is busy for longer than the ttl (a burst of thousands of
    events) must not lose its lease for that; the thread only needs the GIL for a moment every ttl/3,
    which Python's switch interval grants even to a CPU-bound loop. A SIGKILLed process takes the thread
    with it, so etcd still expires the lease within the ttl.

    `run()` is the loop side (spawn it as a task): it starts the thread and marks the loop alive every
    ttl/3. A loop that shows no sign of life for `stall_limit_s` (wedged, not merely busy) is let go: the
    thread stops refreshing and the lease expires, so a stuck leader still hands over. `lost` is set (on
    the loop) when etcd says the lease expired or refreshing stopped.

    `confirmed_until` (`lease_clock`) is when the lease can expire at the earliest, as far as this process
    knows: the send time of the last refresh etcd confirmed (or of the grant, `granted_at`) plus its ttl. etcd
    counts a ttl from when it receives the refresh, never earlier. Past it, another candidate may lead (a
    process stopped for longer than the ttl learns that its lease is gone only from its next refresh).
    """

    def __init__(self, store: Store, lease: Lease, *, stall_limit_s: float | None = None,
                 granted_at: float | None = None) -> None:
        self.target = grpc_target(store.settings.etcd_hosts())
        self.options = list(channel_options(store.settings.etcd_hosts()).items())
        self.tls = etcd_tls(store.settings, store.source)
        self.lease = lease
        self.interval = max(lease.ttl / 3.0, 0.2)
        self.stall_limit_s = stall_limit_s if stall_limit_s is not None else max(30.0, 10.0 * lease.ttl)
        self.lost = asyncio.Event()
        self.refreshes = 0  # successful refreshes (tests, health)
        # Written by the thread (one float: atomic), read by the loop. Unknown grant time: no confirmation yet.
        self.confirmed_until = (granted_at + lease.ttl) if granted_at is not None else 0.0
        self._stop = threading.Event()
        self._beat = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._refresh_forever, name=f"lease-keepalive-{self.lease.id:x}",
                                         daemon=True)
        self._thread.start()
        try:
            while not self.lost.is_set():
                self._beat = time.monotonic()
                await asyncio.sleep(self.interval)
        finally:
            self._stop.set()

    def stop(self) -> None:
        self._stop.set()

    def _set_lost(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self.lost.set)

    def _channel(self, tls: grpc.ChannelCredentials | None) -> grpc.Channel:
        return (grpc.insecure_channel(self.target, options=self.options) if tls is None
                else grpc.secure_channel(self.target, tls, options=self.options))

    def _refresh_forever(self) -> None:
        channel = self._channel(None if self.tls is None else self.tls.credentials())
        stub = rpc.LeaseStub(channel)
        try:
            while not self._stop.wait(self.interval):
                fresh = None if self.tls is None else self.tls.renewed()
                if fresh is not None:  # rotated certificates: a new channel (nothing else runs on the old one)
                    channel.close()
                    channel = self._channel(fresh)
                    stub = rpc.LeaseStub(channel)
                stalled = time.monotonic() - self._beat
                if stalled > self.stall_limit_s:
                    log.error("event loop silent for %.0f s: letting etcd lease %x expire", stalled, self.lease.id)
                    self._set_lost()
                    return
                sent = lease_clock()
                try:
                    replies = stub.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=self.lease.id)]),
                                                  timeout=max(self.interval, 1.0))
                    reply = next(replies)
                    replies.cancel()
                except (grpc.RpcError, StopIteration) as e:  # etcd briefly unreachable: try again next tick
                    log.warning("lease keep-alive failed: %s", e)
                    continue
                if reply.TTL <= 0:
                    log.error("etcd lease %x expired", self.lease.id)
                    self._set_lost()
                    return
                self.confirmed_until = sent + min(int(reply.TTL), self.lease.ttl)
                self.refreshes += 1
        finally:
            channel.close()


class LeaderElection:
    """One leader per `name`: the leader's id sits at `leader/<name>`, bound to its lease.

    A killed leader stops refreshing; etcd deletes the key when the lease expires and the next
    campaigner's create succeeds. `lost` tells the leader it must stop acting (lease gone); the owner then
    resigns and may campaign again in the same process (a new lease, a new key).

    `term` is the leader key's create revision: unique to one tenure (a key created again, even for the same
    candidate, has a higher one), so writes guarded by `fence(t)` can never land in a later term, nor
    another candidate's.
    """

    def __init__(self, store: Store, name: str, candidate: str, *, ttl: int = 3) -> None:
        self.store = store
        self.key = f"leader/{name}"
        self.candidate = candidate
        self.ttl = ttl
        self.lease: Lease | None = None
        self.keepalive: ThreadKeepAlive | None = None
        self._ka_task: asyncio.Task[None] | None = None
        self.term = 0  # the leader key's create revision while leading; 0 when not

    async def campaign(self, *, poll_s: float = 0.2) -> None:
        """Return once this candidate is the leader."""
        asked = lease_clock()
        self.lease = await self.store.grant(self.ttl)
        # From a thread: a leader busy for longer than the ttl keeps its lease (ThreadKeepAlive).
        self.keepalive = ThreadKeepAlive(self.store, self.lease, granted_at=asked)
        self._ka_task = asyncio.create_task(self.keepalive.run(), name=f"leader-keepalive:{self.key}")
        while True:
            if await self.store.create(self.key, self.candidate, lease=self.lease):
                found = await self.store.client.get(self.store.full(self.key))
                if found is not None and found.lease == self.lease.id:
                    self.term = found.create_revision
                    log.info("%s is leader of %s (term %d)", self.candidate, self.key, self.term)
                    return
                continue  # gone again already (an expiry raced us): campaign on
            found = await self.store.client.get(self.store.full(self.key))
            if found is not None and found.value.decode() == self.candidate and found.lease != self.lease.id:
                # Our own key from an earlier term (its lease not yet expired, its keep-alive stopped): not a
                # tenure we can act in, since nothing refreshes it. Clear it and campaign for a fresh one.
                await self.store.delete_if(self.key, self.candidate)
                continue
            await self._wait_for_vacancy(poll_s)

    async def _wait_for_vacancy(self, poll_s: float) -> None:
        # A watch would be tighter, but a poll at 200 ms keeps hand-over within lease ttl + poll.
        await asyncio.sleep(poll_s)

    async def leader(self) -> str | None:
        raw = await self.store.get(self.key)
        return raw.decode() if raw else None

    async def is_leader(self) -> bool:
        return (await self.leader()) == self.candidate

    def holds(self) -> bool:
        """Leading right now, as far as this process can tell without asking etcd: in a term, the lease not
        found lost, and confirmed recently enough that it cannot have expired yet (`confirmed_until`). A process
        resumed after a stop past the ttl (SIGSTOP, a paused VM) holds no more, before its keep-alive has heard
        that the lease is gone: it must not act (publish, command) on the term it had."""
        ka = self.keepalive
        return (self.term != 0 and ka is not None and not ka.lost.is_set()
                and lease_clock() < ka.confirmed_until)

    async def confirm(self, within_s: float, *, poll_s: float = 0.02) -> bool:
        """Wait up to `within_s` for `holds()` (a refresh confirming the lease again, every ttl/3); False when the
        lease is found lost or no refresh confirmed it in time."""
        deadline = lease_clock() + within_s
        while not self.holds():
            ka = self.keepalive
            if self.term == 0 or ka is None or ka.lost.is_set() or lease_clock() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    @staticmethod
    async def current_term(store: Store, name: str) -> int:
        """The term of whoever leads `name` now (its key's create revision, read linearizably), 0 while nobody does:
        what a receiver of a leader's commands holds their term against (services/dc_manager/terms.py)."""
        found = await store._read(store.client.get, store.full(f"leader/{name}"))
        return 0 if found is None else int(found.create_revision)

    def fence(self, t: Any) -> list[Any]:
        """Transaction comparisons that hold only while this term's leader key exists (`BatchWriter` guard)."""
        return [t.create(self.store.full(self.key)) == self.term]

    async def resign(self) -> None:
        """Stop refreshing, delete the key if it is still ours, revoke the lease; best effort (etcd may be
        unreachable: the lease then expires by itself). A later `campaign()` starts a new term."""
        self.term = 0
        if self.keepalive is not None:
            self.keepalive.stop()
        if self._ka_task:
            self._ka_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._ka_task
        if self.lease:
            with contextlib.suppress(Exception):
                await self.store.delete_if(self.key, self.candidate)
            await self.store.revoke(self.lease)
            self.lease = None

    @property
    def lost(self) -> asyncio.Event:
        assert self.keepalive is not None, "campaign() first"
        return self.keepalive.lost
