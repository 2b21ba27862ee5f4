"""One engine connection: who it is (hello + SO_PEERCRED), what it may do, and the replies it gets.

Identity is the kernel's word (pid, uid from SO_PEERCRED) plus the engine id given in hello. Rules:
1. Fds of a lease go only to its owner (same engine id and uid), or to the successor holding the transfer
   token (and, when the control plane named one, being that successor) after the predecessor is dead.
2. Requests that change a lease carry its epoch; an older (or newer) epoch is refused as stale.
3. A warm standby holding the share token the control plane obtained for it (`share` command) gets read-only
   fds of the owner's committed weight leases, nothing else; ownership does not move.
4. Every bad request gets a typed error reply; a frame that breaks the framing closes this connection
   only. Other connections and the lease table are untouched. Running out of fds or memory while serving a
   request is a typed reply too (too_many_fds, out_of_memory), not a dropped connection; so is a reply that would
   pass the frame limit (reply_too_large, sent instead of it).
5. Limits (limits.py): connections per uid and per process, chunks per lease, chunk fds per client and under the
   manager's RLIMIT_NOFILE, bytes per gpu; each refused with its typed error.
6. Deadlines: the hello must be whole within `hello_timeout_s` of the connect (and any frame before it at most
   `MAX_HELLO_BYTES`); after it, a frame once begun must be whole within `frame_timeout_s` (both answered
   `timeout`, then closed), and a connection silent for
   `idle_timeout_s` is closed without a reply (a reply nobody asked for would be read as the answer to the
   client's next request; the SDK sees the close and reconnects); silent for `unleased_idle_timeout_s` (60 s)
   when its process holds no lease, so a uid's connection slots are not held for an hour by connections holding
   nothing (engines heartbeat every 0.5 s; a lease holder's connection keeps the long deadline). A reply must be
   taken by the client within `frame_timeout_s` too: a client that stops reading its replies (its socket full) is
   closed, not kept with its connection slot for good. No wait here blocks another connection.
7. Listings answer for the caller only: `pending` shows leases of the caller's engine id *and* uid.
8. A gang's leases (a tensor-parallel engine's ranks') move only with the gang (gangs.py): `gang_takeover` by
   every rank of the successor group; a plain `takeover` of one rank's leases is refused (`partial_gang`). A
   gang is registered only by its rank 0 (`owners[0]`), the process holding rank 0's leases, naming its own group's
   ranks only (`rank_engine_id`: gangs.py invariant 8), so no engine binds another's leases into a gang.
9. A request naming another uid's lease, or an engine id whose leases are all another uid's, gets the answer an
   unknown one gets (scope.py): no uid learns which lease ids or engine ids exist beyond its own. So does one naming
   another uid's gang (`gang_takeover`) or a rank whose leases are another uid's (`gang_register`): gangs.py
   invariant 7.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import time
from dataclasses import dataclass
from typing import Any

from libs.client.protocol import (
    Allocate,
    AnswerReq,
    Attach,
    Commit,
    CommitReply,
    FencePid,
    GangRegister,
    GangTakeover,
    GrantReply,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    LeaseGrant,
    NotFrozenYet,
    OutOfOrder,
    PartialGang,
    PeerServed,
    Pending,
    PendingReply,
    PredecessorAlive,
    Register,
    Release,
    ReplyTooLarge,
    RestoreReq,
    Resume,
    ResumeReply,
    ShareReq,
    SleepReq,
    TakeoverReq,
    WakeReq,
    error,
    ok,
    parse_request,
    tensor_extent,
)
from libs.common.errors import (
    CommandTimeout,
    Conflict,
    HoldfastError,
    MalformedMessage,
    NotFound,
    PermissionDenied,
    StaleEpoch,
)
from libs.common.events import LeaseState
from libs.common.procs import ms_since, stopped
from libs.common.wire import FrameStream, FrameTooLarge, PeerClosed, close_fds, encode_payload
from services.gpu_manager.backends import exhausted_error
from services.gpu_manager.fsm import HELD, LIVE, LeaseEvent
from services.gpu_manager.gangs import GangBook
from services.gpu_manager.limits import ClientLimits, ConnectionCount, Usage, lease_shape
from services.gpu_manager.manager import LeaseBook, Move, backup_alone, same_token
from services.gpu_manager.records import LeaseRecord, layout_hash, pid_start_time
from services.gpu_manager.restore import WeightCopies
from services.gpu_manager.scope import foreign_owner, hidden, lease_for
from services.gpu_manager.sleep import Sleeper, resident_bytes

log = logging.getLogger("holdfast.gpu_manager.session")

# A takeover sent before its predecessor's freeze is held this long for it (`_takeover_once_frozen`); then told
# `not_frozen_yet` (the client asks again until its own deadline). Its connection's other requests wait behind it:
# an engine's client asks one thing at a time.
FROZEN_WAIT_S = 0.25

# Fds a frame from an engine may declare. Engines send none: one is still read (closed, refused, the connection
# kept), more are refused from the frame's header, so the manager takes at most the first batch of them (the
# transport's default let a frame bring 16384, every one held until the frame ended or timed out).
MAX_FDS_IN = 1
# The largest frame read before a connection's hello: a hello is well under it (two ids of at most 256 characters),
# and every other request before it is refused anyway. Above it the frame is refused from its header (rule 6), so
# a connection that never says hello holds this much of the manager's memory, not `max_frame_bytes` (16 MiB).
MAX_HELLO_BYTES = 8192
# What a successor's grant may hold beyond its owner's: per lease (its own engine id and class), and once (its fence,
# a gang's view of up to 64 ranks): the room a commit leaves under the frame limit.
GRANT_SLACK_PER_LEASE = 1024
GRANT_SLACK = 32 * 1024


@dataclass
class Peer:
    engine_id: str
    engine_class: str
    pid: int
    uid: int
    pid_start: int | None


class Idle(Exception):
    """The connection was silent past its idle deadline after its hello (closed without a reply)."""


class Unread(Exception):
    """A reply was not taken by the client within `frame_timeout_s` (part of it may be sent: the connection is
    closed)."""


def fd_usage() -> tuple[int, int]:
    """(open fds, soft RLIMIT_NOFILE) of this process. Listing /proc/self/fd takes an fd itself: when none is left
    the table is full, which is what health must then say (it failed instead, and its requests went unanswered
    until an fd freed: ~50 s in tests/gpu_manager/test_accept_fd_exhaustion.py)."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        return len(os.listdir("/proc/self/fd")), limit
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            return limit, limit
        raise


class EngineSession:
    def __init__(self, book: LeaseBook, stream: FrameStream, conns: ConnectionCount,
                 copies: WeightCopies | None = None, sleeper: Sleeper | None = None, *, gangs: GangBook) -> None:
        self.book = book
        self.gangs = gangs  # tensor-parallel engines' leases, moved together (gangs.py, built on the book)
        self.copies = copies
        self.sleeper = sleeper
        self.stream = stream
        self.conns = conns
        creds = stream.peer_credentials()
        self.pid, self.uid = creds.pid, creds.uid
        self.peer: Peer | None = None
        self.lock_wait_ms = 0.0  # how long the last request under the lease table's lock waited for it
        self.read_at = (0.0, 0.0)  # when the last frame was read whole: (perf_counter, wall clock)
        self.hello_by = asyncio.get_running_loop().time() + book.settings.hello_timeout_s

    async def serve(self) -> None:
        try:
            self.conns.admit(self.uid, self.pid)
        except HoldfastError as e:
            self.conns.refused += 1
            if self.conns.refused & (self.conns.refused - 1) == 0:  # the 1st, 2nd, 4th...: a flood logs little
                log.warning("refused a connection of pid %d: %s (%d refused so far)", self.pid, e, self.conns.refused)
            with contextlib.suppress(Unread):
                await self._send(error(e))
            return
        try:
            await self._serve()
        finally:
            self.conns.release(self.uid, self.pid)

    async def _serve(self) -> None:
        try:
            while True:
                try:
                    req, fds = await self._next_frame()
                except (PeerClosed, Idle):
                    return
                except (MalformedMessage, CommandTimeout) as e:  # framing is lost: answer, then drop this one
                    self.book.rejected += 1
                    await self._send(error(e))
                    return
                if fds:
                    close_fds(fds)  # engines never send fds to the manager
                    self.book.rejected += 1
                    await self._send(error(MalformedMessage(f"unexpected {len(fds)} fds")))
                    continue
                self.read_at = (time.perf_counter(), time.time())
                reply, out_fds = await self._answer(req)
                await self._send(reply, out_fds)
        except (ConnectionError, OSError) as e:
            log.info("connection of pid %d lost: %r", self.pid, e)
        except Unread as e:
            log.info("closing the connection of pid %d: %s", self.pid, e)
        finally:
            await self._closed()

    async def _next_frame(self) -> tuple[dict[str, Any], list[int]]:
        """The next frame within its deadline (rule 6)."""
        settings = self.book.settings
        if self.peer is None:
            left = self.hello_by - asyncio.get_running_loop().time()
            self.stream.max_size = min(MAX_HELLO_BYTES, settings.max_frame_bytes)  # read with it, this frame only
            try:
                return await _within(self.stream.recv(), left, f"no hello within {settings.hello_timeout_s} s")
            finally:
                self.stream.max_size = settings.max_frame_bytes
        await self._until_readable(self.peer)
        return await _within(self.stream.recv(), settings.frame_timeout_s,
                             f"a frame begun was not whole within {settings.frame_timeout_s} s")

    async def _until_readable(self, peer: Peer) -> None:
        """Until the next frame begins, or `Idle` past the idle deadline (rule 6): `idle_timeout_s` of silence while
        this process holds a lease, `unleased_idle_timeout_s` (if shorter) while it holds none; re-judged at least
        that often, so a lease taken or let go meanwhile (on another connection) counts from then on."""
        settings = self.book.settings
        unleased = min((t for t in (settings.idle_timeout_s, settings.unleased_idle_timeout_s) if t), default=0.0)
        loop = asyncio.get_running_loop()
        since = loop.time()
        while True:
            holds = self._holds_lease()
            limit = settings.idle_timeout_s if holds else unleased  # 0: no deadline
            left = since + limit - loop.time()
            if limit and left <= 0:
                log.info("closing the connection of %s (pid %d): silent for %s s%s", peer.engine_id, self.pid, limit,
                         "" if holds else ", its process holding no lease")
                raise Idle
            waits = [t for t in (left if limit else 0.0, unleased) if t > 0]
            step = min(waits) if waits else None  # the deadline, and every `unleased` s at least to judge again
            try:
                await asyncio.wait_for(self.stream.wait_readable(), step)
                return
            except TimeoutError:
                continue

    def _holds_lease(self) -> bool:
        return any(r.owner_pid == self.pid and r.info.state in HELD for r in self.book.records.values())

    async def _send(self, reply: dict[str, Any], fds: list[int] | None = None) -> None:
        """Send a reply within `frame_timeout_s` (rule 6), or raise `Unread`."""
        limit = self.book.settings.frame_timeout_s
        try:
            async with asyncio.timeout(limit):  # no task of its own: a reply on the takeover's path costs no more
                await self.stream.send(reply, fds or ())
        except TimeoutError:
            raise Unread(f"a reply was not read within {limit} s") from None
        except FrameTooLarge as e:  # refused while encoding, before a byte or fd went out: say so instead (rule 4)
            log.warning("a reply to pid %d was not sent: %s", self.pid, e)
            await self._send(error(ReplyTooLarge(f"the reply is over the frame limit ({e}): ask for less at once")))
        except (ConnectionError, OSError):
            pass

    async def _closed(self) -> None:
        # Socket close is the fast path for a crash: if the owner process is gone, orphan its leases now.
        if self.peer is None:
            return
        if pid_start_time(self.pid) is None:
            await self.book.owner_exited(self.pid)
        else:
            self.book.forget_pid(self.pid)  # alive, maybe owning nothing: no pidfd kept for it

    async def _answer(self, obj: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        try:
            req = parse_request(obj)
            if isinstance(req, Hello):
                return ok(await self.hello(req)), []
            if self.peer is None:
                raise OutOfOrder(f"'{req.op}' before hello")
            if isinstance(req, RestoreReq):  # takes the lock only around its allocate and register: its copy
                return await self.restore(req, self.peer)  # runs for seconds while others are served
            if isinstance(req, SleepReq | WakeReq | AnswerReq):  # the same: a weights copy runs off the lock
                return await self.sleep_wake(req, self.peer)
            if isinstance(req, GangTakeover):  # waits for the group's other ranks: the lock only around its checks
                return await self.gang_takeover(req, self.peer)
            if isinstance(req, TakeoverReq):
                return await self._takeover_once_frozen(req, self.peer)
            t_lock = time.perf_counter()
            async with self.book.lock:
                self.lock_wait_ms = ms_since(t_lock)  # for the takeover's log line and reply
                return await self._dispatch(req, self.peer)
        except HoldfastError as e:
            if isinstance(e, MalformedMessage):
                self.book.rejected += 1
            return error(e), []
        except OSError as e:  # out of fds or memory mid-request: the client learns, the connection stays
            typed = exhausted_error(e, obj.get("op"))
            if typed is None:
                raise
            log.warning("%s from pid %d failed: %s", obj.get("op"), self.pid, typed)
            return error(typed), []

    async def _takeover_once_frozen(self, req: TakeoverReq, peer: Peer) -> tuple[dict[str, Any], list[int]]:
        """A takeover; one that comes before its predecessor's leases are frozen (a standby promoted while the
        freeze is under way: the agent's own promotion, the dc_manager's early one) is held here until a commit
        freezes them, up to FROZEN_WAIT_S, rather than told `not_frozen_yet` and left to ask again a poll interval
        later (5 ms). The lock is not held while it waits."""
        deadline = time.monotonic() + FROZEN_WAIT_S
        while True:
            t_lock = time.perf_counter()
            async with self.book.lock:
                self.lock_wait_ms = ms_since(t_lock)
                try:
                    return await self._dispatch(req, peer)
                except NotFrozenYet:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    changed = self.book.changed  # under the lock: no commit between the check and the wait
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    async def _dispatch(self, req: Any, peer: Peer) -> tuple[dict[str, Any], list[int]]:
        if isinstance(req, Allocate):
            self._admit_allocate(req, peer)
            rec = await self.book.create(owner=peer.engine_id, engine_class=peer.engine_class, uid=peer.uid,
                                         pid=peer.pid, pid_start=peer.pid_start, gpu=req.gpu, size=req.size,
                                         tag=req.tag, name=req.name, chunk_size=req.chunk_size, host=req.host)
            return self._grant([rec])
        if isinstance(req, Register):
            await self.register(req, peer)
            return ok(), []
        if isinstance(req, Commit):
            return ok(await self.commit(peer)), []
        if isinstance(req, Pending):
            return ok(PendingReply(leases=[r.info for r in self.pending(peer)])), []
        if isinstance(req, Attach):
            return self._grant(await self.attach(peer))
        if isinstance(req, TakeoverReq):
            t0 = time.perf_counter()
            recs, fence = await self.takeover(req, peer)
            # the takeover's path through this process: read, then parsed and waiting for the lease table, then
            # granted; `read_wall` places the read on the client's clock (same host) to split its request time
            took = {"read_wall": self.read_at[1], "parsed_ms": round((t0 - self.read_at[0]) * 1000 - self.lock_wait_ms, 3),
                    "lock_wait_ms": self.lock_wait_ms, "grant_ms": ms_since(t0)}
            granted = self._grant(recs, fence=fence, manager_ms=took, held=req.held)
            log.info("takeover of %s's %d leases (%d fds) by %s (pid %d): granted in %.2f ms (one commit) after %.2f ms "
                     "waiting for the lease table%s", req.predecessor, len(recs), len(granted[1]), peer.engine_id,
                     peer.pid, took["grant_ms"], self.lock_wait_ms,
                     f", fenced on pids {[f.pid for f in fence]}" if fence else "")
            return granted
        if isinstance(req, ShareReq):
            return self._grant(self.share(req, peer), read_only=True)
        if isinstance(req, GangRegister):
            if req.owners[0] != peer.engine_id:  # rule 8: rank 0 registers its own gang, no one else's
                raise PermissionDenied(f"gang {req.gang_id} is registered by its rank 0 ({req.owners[0]}), "
                                       f"not by {peer.engine_id}")
            return ok((await self.gangs.register(req, peer)).view()), []
        if isinstance(req, Heartbeat):
            now = time.time()
            mine = self._mine(peer)
            for rec in mine:
                rec.update(last_seen=now)
            ask = self.sleeper.ask_for(peer.engine_id, peer.pid) if self.sleeper is not None else None
            return ok(HeartbeatReply(ask=ask)), []
        if isinstance(req, Resume):
            return ok(await self.resume(req, peer)), []
        if isinstance(req, Release):
            rec = self._owned(req.lease_id, req.epoch, peer)
            await self.book.apply(rec, LeaseEvent.RELEASE, "released")
            return ok(), []
        raise MalformedMessage(f"unhandled op {req.op}")

    # ------------------------------------------------------------ operations

    async def hello(self, req: Hello) -> HelloReply:
        if self.peer is not None:
            raise OutOfOrder("hello twice on one connection")
        self.peer = Peer(req.engine_id, req.engine_class, self.pid, self.uid, pid_start_time(self.pid))
        self.book.watch_pid(self.pid)
        backend = self.book.backend
        return HelloReply(node=self.book.settings.node, backend=backend.name,
                          chunk_size=self.book.settings.chunk_mib * 1024 * 1024,
                          granularity=backend.granularity(0) if backend.name == "host" else 0,
                          manager_pid=os.getpid())

    def _admit_allocate(self, req: Allocate, peer: Peer) -> None:
        """Limits of rule 5, checked here rather than in LeaseBook.create: they are about who asks (the
        calling process, its connection) and the manager's fds, which the session knows; the book stays the
        table. Under the book's lock, so two allocates cannot both pass on the same counts."""
        backend, settings = self.book.backend, self.book.settings
        backend.check_gpu(req.gpu)
        shape = lease_shape(req.size, req.chunk_size or settings.chunk_mib * 1024 * 1024,
                            backend.granularity(req.gpu))
        live = self.book.records.values()
        open_fds, fd_limit = fd_usage()
        usage = Usage(client_fds=sum(_chunks(r) for r in live if r.owner_pid == peer.pid and r.info.state in LIVE),
                      open_fds=open_fds, fd_limit=fd_limit,
                      leased_bytes=resident_bytes(live, None if backend.name == "host" else req.gpu),
                      capacity=backend.capacity(req.gpu))
        ClientLimits(settings.max_chunks_per_lease, settings.max_fds_per_client, settings.fd_reserve,
                     settings.fd_share_per_client).check_allocate(shape, usage)

    def _mine(self, peer: Peer) -> list[LeaseRecord]:
        return [r for r in self.book.records.values()
                if r.info.owner == peer.engine_id and r.owner_pid == peer.pid and r.info.state == LeaseState.ACTIVE]

    def _owned(self, lease_id: str, epoch: int, peer: Peer) -> LeaseRecord:
        rec = lease_for(self.book.records, lease_id, asker=peer.engine_id, uid=peer.uid, pid=peer.pid)  # rule 9
        if rec.info.owner != peer.engine_id:
            raise PermissionDenied(f"lease {lease_id} is not held by {peer.engine_id}")
        if epoch != rec.info.epoch:
            raise StaleEpoch(f"lease {lease_id} is at epoch {rec.info.epoch}, request carries {epoch}")
        if rec.info.state != LeaseState.ACTIVE or rec.owner_pid != peer.pid:
            raise PermissionDenied(f"lease {lease_id} is {rec.info.state.value}, not attached by pid {peer.pid}")
        return rec

    async def register(self, req: Register, peer: Peer) -> None:
        touched = []
        for meta in req.tensors:
            if meta.lease_id not in req.epochs:
                raise MalformedMessage(f"tensor {meta.name}: no epoch given for lease {meta.lease_id}")
            rec = self._owned(meta.lease_id, req.epochs[meta.lease_id], peer)
            if meta.offset + tensor_extent(meta) > rec.info.size:
                raise MalformedMessage(f"tensor {meta.name} ends past lease {rec.id} ({rec.info.size} bytes)")
            touched.append((rec, meta))

        def change() -> None:  # validated all before changing any
            for rec, meta in touched:
                rec.set_tensor(meta)
                rec.update(layout_hash=None)

        await self.book.update(list({id(r): r for r, _ in touched}.values()), change)

    async def commit(self, peer: Peer) -> CommitReply:
        mine = self._mine(peer)
        self._check_grantable(mine)
        digest = layout_hash([t for r in mine for t in r.tensors.values()])

        def change() -> None:
            for rec in mine:
                rec.update(layout_hash=digest)

        await self.book.update(mine, change)
        for rec in mine:  # announced once durable
            self.book.mirror.lease_changed(rec.info, rec.info.state, "committed")
        if self.copies is not None:
            self.copies.after_commit(mine)  # the artifact and host tier copies the settings ask for
        return CommitReply(layout_hash=digest)

    def _check_grantable(self, recs: list[LeaseRecord]) -> None:
        """Refuse to commit a set whose grant would not fit in one frame: a successor's takeover would move the
        leases and then get `reply_too_large` instead of their fds (found at failover time). Refused here, the engine
        learns at start-up; its uncommitted leases are reclaimed at a freeze (the successor cold-starts)."""
        reply, _ = self._grant(recs)
        size = len(encode_payload(reply)) + GRANT_SLACK_PER_LEASE * len(recs) + GRANT_SLACK
        limit = self.book.settings.max_frame_bytes
        if size > limit:
            raise ReplyTooLarge(f"{len(recs)} leases with {sum(len(r.tensors) for r in recs)} tensors: their grant "
                                f"would be about {size} bytes, over the frame limit of {limit}; register fewer tensors")

    def pending(self, peer: Peer) -> list[LeaseRecord]:
        """Leases waiting for this engine id, of this uid only (rule 7: another user naming the same engine id
        learns nothing)."""
        out = []
        for rec in self.book.records.values():
            state = rec.info.state
            if rec.owner_uid != peer.uid:
                continue
            if rec.info.owner == peer.engine_id and (
                    state == LeaseState.ORPHANED or state == LeaseState.ACTIVE and rec.owner_pid != peer.pid):
                out.append(rec)
            elif state == LeaseState.FROZEN and (rec.successor == peer.engine_id or rec.info.owner == peer.engine_id):
                out.append(rec)
        return out

    async def attach(self, peer: Peer) -> list[LeaseRecord]:
        """Same engine id, new process: claim its own leases back (ORPHANED -> ACTIVE, epoch+1)."""
        claim, already = [], []
        for rec in self.book.records.values():
            if rec.info.owner != peer.engine_id or rec.info.state not in (LeaseState.ACTIVE, LeaseState.ORPHANED):
                continue
            if rec.owner_uid != peer.uid:  # as if there were none (rule 9): not its id, not its state
                hidden(f"lease {rec.id}", rec.owner_uid, asker=peer.engine_id, uid=peer.uid, pid=peer.pid)
                continue
            if rec.info.state == LeaseState.ACTIVE:
                if rec.owner_pid == peer.pid:
                    already.append(rec)  # e.g. the manager restarted under a live engine
                    continue
                if self.book.owner_alive(rec):
                    raise Conflict(f"{peer.engine_id} is still held by live pid {rec.owner_pid}")
            claim.append(rec)
        moves = []
        for rec in claim:  # a dead owner's ACTIVE lease: both transitions, one commit with the others
            if rec.info.state == LeaseState.ACTIVE:
                moves.append(Move(rec, LeaseEvent.OWNER_LOST, "owner_exited"))
            moves.append(Move(rec, LeaseEvent.REATTACH, "reattached",
                              {"owner_pid": peer.pid, "owner_pid_start": peer.pid_start}))
        await self.book.apply_all(moves)
        return already + claim

    async def resume(self, req: Resume, peer: Peer) -> ResumeReply:
        """A live engine on a new connection re-establishes its leases without fds (its mappings stay).

        Held: the lease is still ACTIVE, owned by this engine id, uid and process, at the epoch it names (a
        manager restart leaves live owners' rows ACTIVE). Anything else is lost and said why: reclaimed,
        another owner, another epoch (someone attached or took over meanwhile), frozen for a successor. An
        ORPHANED lease at the same epoch whose recorded owner is this very process is claimed back
        (REATTACH, epoch + 1), as `attach` would."""
        held, lost, moves = [], {}, []
        for lease_id, epoch in req.epochs.items():
            try:
                rec = lease_for(self.book.records, lease_id, asker=peer.engine_id, uid=peer.uid, pid=peer.pid)
            except NotFound:  # unknown, or another uid's: one answer (rule 9)
                lost[lease_id] = "reclaimed"
                continue
            if rec.info.owner != peer.engine_id:
                lost[lease_id] = "owned by another engine"
            elif rec.info.epoch != epoch:
                lost[lease_id] = f"stale_epoch: the lease is at epoch {rec.info.epoch}, this engine holds {epoch}"
            elif rec.owner_pid != peer.pid:
                lost[lease_id] = f"held by another process (pid {rec.owner_pid})"
            elif rec.info.state in (LeaseState.ACTIVE, LeaseState.SLEEPING):  # asleep: still its, memory or not
                held.append(rec)
            elif rec.info.state == LeaseState.ORPHANED:
                moves.append(Move(rec, LeaseEvent.REATTACH, "resumed", {"owner_pid_start": peer.pid_start}))
                held.append(rec)
            else:
                lost[lease_id] = f"{rec.info.state.value.lower()}: waiting for a successor"
        await self.book.apply_all(moves)
        if lost:
            log.warning("resume by %s (pid %d): %d leases lost: %s", peer.engine_id, peer.pid, len(lost), lost)
        return ResumeReply(held=[r.info for r in held], lost=lost)

    async def takeover(self, req: TakeoverReq, peer: Peer) -> tuple[list[LeaseRecord], list[FencePid]]:
        """A successor claims a frozen predecessor's leases (FROZEN -> ACTIVE, epoch+1, owner = successor); and,
        for a fenced request, the stopped predecessors it must see exit before it writes."""
        if foreign_owner(self.book.records, req.predecessor, asker=peer.engine_id, uid=peer.uid, pid=peer.pid):
            raise NotFound(f"{req.predecessor} has no frozen leases")  # as LeaseBook's for an unknown one (rule 9)
        frozen = self.book.frozen_for_transfer(req.predecessor, req.transfer_token, req.cold_weights)
        fence: dict[int, FencePid] = {}
        for rec in frozen:
            gang = self.gangs.member_of(rec.id)
            if gang is not None:  # rule 8
                raise PartialGang(f"lease {rec.id} is rank {gang.rank_of(rec.info.owner)} of gang {gang.gang_id}: "
                                  "its successor group takes the whole gang over (gang_takeover)")
            if rec.successor is not None and rec.successor != peer.engine_id:
                raise PermissionDenied(f"lease {rec.id} is promised to {rec.successor}")
            if rec.owner_uid != peer.uid:
                raise PermissionDenied(f"lease {rec.id} belongs to another user")
            if rec.owner_pid != peer.pid and self.book.owner_alive(rec):
                if not (req.fenced and rec.owner_pid is not None and stopped(rec.owner_pid, rec.owner_pid_start)):
                    raise PredecessorAlive(f"{req.predecessor} (pid {rec.owner_pid}) still runs: kill it first")
                # stopped, its teardown under way: the successor waits for its exit before writing (TakeoverReq)
                fence[rec.owner_pid] = FencePid(pid=rec.owner_pid, pid_start=rec.owner_pid_start)
        # A KV backup handed on alone (`cold_weights`): the successor loads its own weights, so the predecessor's
        # other leases are of no use to anyone; those of a dead owner go in the same commit, before the successor
        # allocates its weights beside them (a regroup's group on the predecessor's GPU: their memory is its room).
        alone = req.cold_weights and all(backup_alone(r) for r in frozen)
        rest = [r for r in self.book.records.values() if r.info.owner == req.predecessor and r.info.state in LIVE
                and r not in frozen and not self.book.owner_alive(r)] if alone else []
        await self.book.apply_all([  # every lease's new epoch in one commit, before any fd goes out
            *(Move(rec, LeaseEvent.TAKEOVER, f"taken over from {req.predecessor}",
                   {"owner": peer.engine_id, "engine_class": peer.engine_class, "owner_pid": peer.pid,
                    "owner_pid_start": peer.pid_start, "transfer_token": None, "successor": None,
                    "handed_from": req.predecessor})
              for rec in frozen),
            *(Move(rec, LeaseEvent.FORCE_RECLAIM, f"not handed on: {peer.engine_id} took {req.predecessor}'s KV "
                   "backup alone") for rec in rest)])
        return frozen, list(fence.values())

    async def gang_takeover(self, req: GangTakeover, peer: Peer) -> tuple[dict[str, Any], list[int]]:
        """This rank's leases of a frozen gang, once its whole group has asked (gangs.py invariant 2)."""
        t0 = time.perf_counter()
        gang, recs = await self.gangs.takeover(req, peer)
        async with self.book.lock:
            reply, fds = self._grant(recs)
        reply["gang"] = gang.view().model_dump(mode="json") if gang is not None else None
        log.info("gang %s: rank %d (%s, pid %d) took %d leases in %.2f ms (the group's wait included)", req.gang_id,
                 req.rank, peer.engine_id, peer.pid, len(recs), (time.perf_counter() - t0) * 1000)
        return reply, fds

    def share(self, req: ShareReq, peer: Peer) -> list[LeaseRecord]:
        """Read-only views of an owner's weights for the standby the control plane named (rule 3)."""
        grant = self.book.share_grants.get(req.share_token)
        if grant is None or not same_token(grant[0], req.owner):
            raise PermissionDenied("wrong share token")
        if grant[1] != peer.engine_id:
            raise PermissionDenied(f"the share of {req.owner}'s weights is for {grant[1]}, not {peer.engine_id}")
        recs = self.book.shareable(req.owner)
        if not recs:
            raise NotFound(f"{req.owner} holds no committed weight leases")
        for rec in recs:
            if rec.owner_uid != peer.uid:
                raise PermissionDenied(f"lease {rec.id} belongs to another user")
        log.info("%s (pid %d) shadows %s: %d weight leases, %d bytes, read-only", peer.engine_id, peer.pid,
                 req.owner, len(recs), sum(r.info.size for r in recs))
        return recs

    async def restore(self, req: RestoreReq, peer: Peer) -> tuple[dict[str, Any], list[int]]:
        """A new weights lease filled from the node's copy of `req.artifact` (restore.py)."""
        if self.copies is None:
            raise NotFound("this gpu_manager keeps no weight copies")

        async def allocate(size: int, tag: Any, name: str) -> LeaseRecord:
            async with self.book.lock:
                self._admit_allocate(Allocate(gpu=req.gpu, size=size, tag=tag, name=name), peer)
                return await self.book.create(owner=peer.engine_id, engine_class=peer.engine_class, uid=peer.uid,
                                              pid=peer.pid, pid_start=peer.pid_start, gpu=req.gpu, size=size,
                                              tag=tag, name=name, chunk_size=None)

        got = await self.copies.restore(req.artifact, list(req.sources), allocate, requester=peer.engine_id,
                                        gpu=req.gpu)
        async with self.book.lock:
            reply, fds = self._grant([got.rec])
        served = None if got.peer is None else PeerServed(lease=got.peer.lease_id, gpu=got.peer.gpu,
                                                          owner=got.peer.owner).model_dump()
        reply.update(source=got.source, restore=got.stats, peer=served, passed=list(got.passed))
        return reply, fds

    async def sleep_wake(self, req: SleepReq | WakeReq | AnswerReq, peer: Peer) -> tuple[dict[str, Any], list[int]]:
        """Release or renew a live engine's physical memory, its addresses kept (sleep.py)."""
        if self.sleeper is None:
            raise NotFound("this gpu_manager does not put engines to sleep")
        if isinstance(req, AnswerReq):
            self.sleeper.answer(req.ask, peer.engine_id, req.error)
            return ok(), []
        if isinstance(req, SleepReq):
            return ok(await self.sleeper.sleep(req, peer.engine_id, peer.uid, peer.pid)), []
        recs, source = await self.sleeper.wake(req, peer.engine_id, peer.uid, peer.pid)
        async with self.book.lock:
            reply, fds = self._grant(recs)
        reply.update(source=source)
        return reply, fds

    def _grant(self, records: list[LeaseRecord], *, read_only: bool = False, fence: list[FencePid] | None = None,
               manager_ms: dict[str, float] | None = None,
               held: dict[str, str] | None = None) -> tuple[dict[str, Any], list[int]]:
        """The reply granting `records`, and their chunks' fds. A lease in `held` (a takeover's: the requester maps it
        already) whose committed layout is the one named goes without fds or tensors: its mapping and tensors are
        the requester's already (a standby's shadow: ~300 tensors and every chunk's fd less on the recovery's path)."""
        if records and not read_only:  # this process owns them now: its exit is seen at once (forget_pid)
            self.book.watch_pid(self.pid)
        grants, fds = [], []
        for rec in records:
            uuid = self.book.backend.gpu_uuid(rec.info.gpu)
            if held and rec.info.layout_hash is not None and held.get(rec.id) == rec.info.layout_hash:
                grants.append(LeaseGrant(lease=rec.info, nfds=0, gpu_uuid=uuid, held=True))
                continue
            rec_fds = self.book.fds_of(rec.id)
            fds.extend(rec_fds)
            grants.append(LeaseGrant(lease=rec.info, nfds=len(rec_fds), gpu_uuid=uuid,
                                     tensors=list(rec.tensors.values()), read_only=read_only))
        return ok(GrantReply(leases=grants, fence=fence or [], manager_ms=manager_ms or {})), fds


async def _within(recv: Any, seconds: float, why: str) -> Any:
    try:
        return await asyncio.wait_for(recv, max(seconds, 0.0))
    except TimeoutError:
        raise CommandTimeout(why) from None


def _chunks(rec: LeaseRecord) -> int:
    return -(-rec.info.size // rec.info.chunk_size)


async def serve_connection(book: LeaseBook, conns: ConnectionCount, stream: FrameStream,
                           copies: WeightCopies | None = None, sleeper: Sleeper | None = None, *,
                           gangs: GangBook) -> None:
    await EngineSession(book, stream, conns, copies, sleeper, gangs=gangs).serve()

