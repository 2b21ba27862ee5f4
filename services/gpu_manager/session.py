"""One engine connection: who it is (hello + SO_PEERCRED), what it may do, and the replies it gets.

Identity is the kernel's word (pid, uid from SO_PEERCRED) plus the engine id given in hello. Rules:
1. Fds of a lease go only to its owner (same engine id and uid), or to the successor holding the transfer
   token (and, when the control plane named one, being that successor) after the predecessor is dead.
2. Requests that change a lease carry its epoch; an older (or newer) epoch is refused as stale.
3. A warm standby holding the share token the control plane obtained for it (`share` command) gets read-only
   fds of the owner's committed weight leases, nothing else; ownership does not move.
4. Every bad request gets a typed error reply; a frame that breaks the framing closes this connection
   only. Other connections and the lease table are untouched.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from libs.client.protocol import (
    Allocate,
    Attach,
    Commit,
    CommitReply,
    GrantReply,
    Heartbeat,
    Hello,
    HelloReply,
    LeaseGrant,
    OutOfOrder,
    Pending,
    PendingReply,
    PredecessorAlive,
    Register,
    Release,
    Resume,
    ResumeReply,
    ShareReq,
    TakeoverReq,
    error,
    ok,
    parse_request,
    tensor_extent,
)
from libs.common.errors import (
    Conflict,
    HoldfastError,
    MalformedMessage,
    NotFound,
    PermissionDenied,
    StaleEpoch,
)
from libs.common.events import LeaseState
from libs.common.wire import FrameStream, PeerClosed, close_fds
from services.gpu_manager.fsm import LeaseEvent
from services.gpu_manager.manager import LeaseBook, Move
from services.gpu_manager.records import LeaseRecord, layout_hash, pid_start_time

log = logging.getLogger("holdfast.gpu_manager.session")


@dataclass
class Peer:
    engine_id: str
    engine_class: str
    pid: int
    uid: int
    pid_start: int | None


class EngineSession:
    def __init__(self, book: LeaseBook, stream: FrameStream) -> None:
        self.book = book
        self.stream = stream
        creds = stream.peer_credentials()
        self.pid, self.uid = creds.pid, creds.uid
        self.peer: Peer | None = None

    async def serve(self) -> None:
        try:
            while True:
                try:
                    req, fds = await self.stream.recv()
                except PeerClosed:
                    return
                except MalformedMessage as e:  # framing is lost: answer, then drop this connection only
                    self.book.rejected += 1
                    await self._send(error(e))
                    return
                if fds:
                    close_fds(fds)  # engines never send fds to the manager
                    self.book.rejected += 1
                    await self._send(error(MalformedMessage(f"unexpected {len(fds)} fds")))
                    continue
                reply, out_fds = await self._answer(req)
                await self._send(reply, out_fds)
        except (ConnectionError, OSError) as e:
            log.info("connection of pid %d lost: %r", self.pid, e)
        finally:
            await self._closed()

    async def _send(self, reply: dict[str, Any], fds: list[int] | None = None) -> None:
        try:
            await self.stream.send(reply, fds or ())
        except (ConnectionError, OSError):
            pass

    async def _closed(self) -> None:
        # Socket close is the fast path for a crash: if the owner process is gone, orphan its leases now.
        if self.peer is not None and pid_start_time(self.pid) is None:
            await self.book.owner_exited(self.pid)

    async def _answer(self, obj: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        try:
            req = parse_request(obj)
            if isinstance(req, Hello):
                return ok(await self.hello(req)), []
            if self.peer is None:
                raise OutOfOrder(f"'{req.op}' before hello")
            async with self.book.lock:
                return await self._dispatch(req, self.peer)
        except HoldfastError as e:
            if isinstance(e, MalformedMessage):
                self.book.rejected += 1
            return error(e), []

    async def _dispatch(self, req: Any, peer: Peer) -> tuple[dict[str, Any], list[int]]:
        if isinstance(req, Allocate):
            rec = await self.book.create(owner=peer.engine_id, engine_class=peer.engine_class, uid=peer.uid,
                                         pid=peer.pid, pid_start=peer.pid_start, gpu=req.gpu, size=req.size,
                                         tag=req.tag, name=req.name, chunk_size=req.chunk_size)
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
            recs = await self.takeover(req, peer)
            granted = self._grant(recs)
            log.info("takeover of %s's %d leases (%d fds) by %s (pid %d): granted in %.2f ms (one commit)",
                     req.predecessor, len(recs), len(granted[1]), peer.engine_id, peer.pid,
                     (time.perf_counter() - t0) * 1000)
            return granted
        if isinstance(req, ShareReq):
            return self._grant(self.share(req, peer), read_only=True)
        if isinstance(req, Heartbeat):
            now = time.time()
            mine = self._mine(peer)
            for rec in mine:
                rec.update(last_seen=now)
            return ok(), []
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

    def _mine(self, peer: Peer) -> list[LeaseRecord]:
        return [r for r in self.book.records.values()
                if r.info.owner == peer.engine_id and r.owner_pid == peer.pid and r.info.state == LeaseState.ACTIVE]

    def _owned(self, lease_id: str, epoch: int, peer: Peer) -> LeaseRecord:
        rec = self.book.get(lease_id)
        if rec.info.owner != peer.engine_id or rec.owner_uid != peer.uid:
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
        for rec, meta in touched:  # validated all before changing any
            rec.set_tensor(meta)
            rec.update(layout_hash=None)
        await self.book.persist(list({id(r): r for r, _ in touched}.values()))

    async def commit(self, peer: Peer) -> CommitReply:
        mine = self._mine(peer)
        digest = layout_hash([t for r in mine for t in r.tensors.values()])
        for rec in mine:
            rec.update(layout_hash=digest)
            self.book.mirror.lease_changed(rec.info, rec.info.state, "committed")
        await self.book.persist(mine)
        return CommitReply(layout_hash=digest)

    def pending(self, peer: Peer) -> list[LeaseRecord]:
        out = []
        for rec in self.book.records.values():
            state = rec.info.state
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
            if rec.owner_uid != peer.uid:
                raise PermissionDenied(f"lease {rec.id} belongs to another user")
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
            rec = self.book.records.get(lease_id)
            if rec is None:
                lost[lease_id] = "reclaimed"
            elif rec.info.owner != peer.engine_id or rec.owner_uid != peer.uid:
                lost[lease_id] = "owned by another engine"
            elif rec.info.epoch != epoch:
                lost[lease_id] = f"stale_epoch: the lease is at epoch {rec.info.epoch}, this engine holds {epoch}"
            elif rec.owner_pid != peer.pid:
                lost[lease_id] = f"held by another process (pid {rec.owner_pid})"
            elif rec.info.state == LeaseState.ACTIVE:
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

    async def takeover(self, req: TakeoverReq, peer: Peer) -> list[LeaseRecord]:
        """A successor claims a frozen predecessor's leases (FROZEN -> ACTIVE, epoch+1, owner = successor)."""
        frozen = self.book.frozen_for_transfer(req.predecessor, req.transfer_token)
        for rec in frozen:
            if rec.successor is not None and rec.successor != peer.engine_id:
                raise PermissionDenied(f"lease {rec.id} is promised to {rec.successor}")
            if rec.owner_uid != peer.uid:
                raise PermissionDenied(f"lease {rec.id} belongs to another user")
            if rec.owner_pid != peer.pid and self.book.owner_alive(rec):
                raise PredecessorAlive(f"{req.predecessor} (pid {rec.owner_pid}) still runs: kill it first")
        await self.book.apply_all([  # every lease's new epoch in one commit, before any fd goes out
            Move(rec, LeaseEvent.TAKEOVER, f"taken over from {req.predecessor}",
                 {"owner": peer.engine_id, "engine_class": peer.engine_class, "owner_pid": peer.pid,
                  "owner_pid_start": peer.pid_start, "transfer_token": None, "successor": None})
            for rec in frozen])
        return frozen

    def share(self, req: ShareReq, peer: Peer) -> list[LeaseRecord]:
        """Read-only views of an owner's weights for the standby the control plane named (rule 3)."""
        grant = self.book.share_grants.get(req.share_token)
        if grant is None or not secrets.compare_digest(grant[0], req.owner):
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

    def _grant(self, records: list[LeaseRecord], *, read_only: bool = False) -> tuple[dict[str, Any], list[int]]:
        grants, fds = [], []
        for rec in records:
            rec_fds = self.book.fds_of(rec.id)
            fds.extend(rec_fds)
            grants.append(LeaseGrant(lease=rec.info, nfds=len(rec_fds), gpu_uuid=self.book.backend.gpu_uuid(rec.info.gpu),
                                     tensors=list(rec.tensors.values()), read_only=read_only))
        return ok(GrantReply(leases=grants)), fds


async def serve_connection(book: LeaseBook, stream: FrameStream) -> None:
    await EngineSession(book, stream).serve()

