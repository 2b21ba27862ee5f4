"""The lease book: the in-memory lease table (write-through to SQL), the memory behind each lease (backend
chunks, duplicated into the fd keeper), owner tracking (pidfds) and the one place transitions happen.

Invariants (numbered as in the service README):
1. Every state change goes through `apply_all` (or `apply`, one move), which asks the transition table
   (fsm.py), so no lease can take a transition the table does not list.
2. The new row is durable (SQL) before the caller acts on it; a new epoch is durable before fds are handed out.
   The moves of one request (every lease of a takeover, OWNER_LOST then REATTACH of an attach) are checked
   first and committed in one transaction: all of them or, if any is refused or the commit fails, none.
3. A lease's memory is freed exactly when it becomes RECLAIMED: manager fds and handles closed, keeper entry
   dropped. Memory of a live lease is always held by the manager and by the keeper.
4. All mutations run under one asyncio lock, so two requests never interleave inside a transition.
5. (README 9) Only a committed set is ever offered to a successor: an uncommitted lease (allocated or registered after the
   owner's last commit: a start-up killed half way) is reclaimed at the freeze, never frozen; an owner with no
   committed weights lease is refused (`NoCommittedWeights`: the control plane cold-starts from the weights
   file); a frozen set with an uncommitted lease or no weights (rows frozen before this rule) is refused to a
   successor (`IncompleteLeaseSet`) rather than handed over for it to crash on missing tensors. One exception, asked
   for on both sides: a freeze `backups_only` freezes an owner's committed KV backups (host memory) alone, and only a
   successor that loads the weights itself (`cold_weights`) is handed such a set (an engine whose weights and cache
   were lost with their GPU, continued from its backup).
6. The gangs (`gangs`: tensor-parallel engines' ranks, gang.py) are durable like the leases: a gang's row changes
   in the same transaction as the lease rows that go with it (`apply_all(moves, gangs=...)`), and a gang ends in
   the commit that reclaims its last lease; `load` reads them back after a restart. Moves that reclaim leases take
   them out of `records` all at once, before any memory is freed: no reader sees part of such a commit.
7. `load` reads each row on its own: a lease or gang row that cannot be read back is set aside (quarantine.py),
   logged with its reason, and every other row is loaded; the manager starts and serves.
8. A write the database refuses (`TableUnwritable`: its disk full) changes nothing: the request that needed it gets
   the typed `unavailable` reply, the records stay as the table has them (`apply_all` stages on copies, `update`
   puts edits back), the reconciler retries on its next pass, and everyone else is served as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from libs.client.protocol import NotFrozenYet, chunk_sizes
from libs.common.errors import HoldfastError, InvariantBroken, NotFound, PermissionDenied
from libs.common.events import LeaseInfo, LeaseState, Tag, holds_kv_backup
from libs.common.ids import new_id
from services.gpu_manager import reconciler
from services.gpu_manager.backends import Backend, Chunk, HostBackend, round_up
from services.gpu_manager.db import LeaseDb, TableUnwritable
from services.gpu_manager.fsm import LIVE, LeaseEvent, transition
from services.gpu_manager.gang import Gang, ended
from services.gpu_manager.gpu_board import GpuBoard
from services.gpu_manager.keeper_client import KeeperClient
from services.gpu_manager.mirror import Mirror
from services.gpu_manager.quarantine import BadRow
from services.gpu_manager.records import LeaseRecord, open_pidfd, process_alive
from services.gpu_manager.settings import GpuManagerSettings
from services.gpu_manager.tier import TIER_PREFIX

log = logging.getLogger("holdfast.gpu_manager")


@dataclasses.dataclass(frozen=True)
class Move:
    """One transition of one lease; `changes` sets LeaseInfo fields or LeaseRecord attributes with it."""

    rec: LeaseRecord
    event: LeaseEvent
    cause: str
    changes: dict[str, Any] = dataclasses.field(default_factory=dict)


SHAREABLE = (Tag.WEIGHTS, Tag.KV_CACHE)


class NoCommittedWeights(NotFound):
    """The owner committed no weights lease (killed while loading): nothing to hand on. Code `not_found`, so
    the control plane goes to its fallback, a cold start from the weights file."""


class IncompleteLeaseSet(HoldfastError):
    """A frozen set a successor cannot run from: a lease without a commit, or no weights at all."""

    code = "incomplete_leases"


def same_token(held: str | None, given: str) -> bool:
    """Whether a client's token is the one held, in constant time, over UTF-8 bytes: `secrets.compare_digest` raises
    TypeError for a str with a non-ASCII character, which the client chooses (its request then went unanswered)."""
    return held is not None and secrets.compare_digest(held.encode(), given.encode())


def committed(rec: LeaseRecord) -> bool:
    """The owner declared the lease's tensors complete (`commit`); a later `register` clears it again."""
    return rec.info.layout_hash is not None


def split_for_freeze(recs: Sequence[LeaseRecord], backups_only: bool = False) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
    """(to freeze, to reclaim) of an owner's live leases (invariant 5, pure): the committed ones are frozen
    only when one of them holds weights; every uncommitted one is reclaimed. `backups_only`: the committed KV
    backups alone are frozen (for a successor that loads the weights itself), nothing else is touched."""
    if backups_only:
        return [r for r in recs if committed(r) and backup_alone(r)], []
    done = [r for r in recs if committed(r)]
    half = [r for r in recs if not committed(r)]
    if not any(r.info.tag == Tag.WEIGHTS for r in done):
        return [], half
    return done, half


def backup_alone(rec: LeaseRecord) -> bool:
    """A KV backup lease in host memory: all a successor that loads its weights itself needs of its predecessor."""
    return holds_kv_backup(rec.info)


def check_complete(owner: str, recs: Sequence[LeaseRecord], cold_weights: bool = False) -> None:
    """Refuse a frozen set that a successor could not run from (invariant 5). `cold_weights`: the successor loads
    the weights itself, so a set of committed KV backups alone is complete for it too."""
    half = [r.id for r in recs if not committed(r)]
    if half:
        raise IncompleteLeaseSet(f"{owner}'s leases {half} were never committed: a successor must cold-start")
    if cold_weights and recs and all(backup_alone(r) for r in recs):
        return
    if not any(r.info.tag == Tag.WEIGHTS for r in recs):
        raise IncompleteLeaseSet(f"{owner}'s frozen leases hold no weights: a successor must cold-start"
                                 + ("" if cold_weights else " (or load them itself: cold_weights)"))


class LeaseBook:
    def __init__(self, settings: GpuManagerSettings, backend: Backend, db: LeaseDb, keeper: KeeperClient,
                 mirror: Mirror) -> None:
        self.settings = settings
        self.backend = backend
        # host leases (LeaseInfo.host): memfds on any backend; the host backend's own on the host backend
        self.host_backend: Backend = backend if backend.name == "host" else HostBackend()
        self.db = db
        self.keeper = keeper
        self.mirror = mirror
        self.records: dict[str, LeaseRecord] = {}
        self.chunks: dict[str, list[Chunk]] = {}
        self.lock = asyncio.Lock()
        self._backend_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backend")
        self._pidfds: dict[int, int] = {}
        self.on_owner_exit: Callable[[int], None] | None = None
        self.rejected = 0  # malformed requests answered with an error (health detail)
        # Read-only shares of weights for warm standbys: token -> (owner, grantee). In memory on purpose: a
        # standby maps once, and its mapping outlives a manager restart (the keeper holds the memory).
        self.share_grants: dict[str, tuple[str, str]] = {}
        self.kept_tier: dict[str, tuple[dict[str, Any], list[int]]] = {}  # the keeper's host tier entries, at load
        # The node's GPUs and their health (set by app.setup; None: any index the backend takes, as before).
        self.board: GpuBoard | None = None
        # Tensor-parallel engines' gangs by id (gangs.py moves them; durable with the leases: invariant 6).
        self.gangs: dict[str, Gang] = {}
        # Set, and replaced, by each commit of `apply_all`: what a request waiting for a change (a takeover sent
        # before its predecessor's freeze: session.py) awaits, taken while it holds the lock.
        self.changed = asyncio.Event()

    # ------------------------------------------------------------ lifecycle

    async def backend_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Backend calls run on one thread (a CUDA context is current per thread)."""
        return await asyncio.get_running_loop().run_in_executor(self._backend_pool, fn, *args)

    async def load(self) -> None:
        """Reload the table and take the memory back from the keeper (after a restart, or a first start)."""
        await self.db.run(self.db.create_schema)
        rows, bad = await self.db.run(self.db.load_live, self.settings.node)
        await self._set_aside(bad)  # before the keeper's listing is matched: their memory is dropped as unknown
        held = await self.keeper.listing()
        for rec in rows:
            meta, fds = held.pop(rec.id, ({}, []))
            sizes = chunk_sizes(rec.info.size, rec.info.chunk_size)
            if rec.info.state == LeaseState.SLEEPING:  # no memory by design (sleep.py, invariant 1)
                for fd in fds:  # a crash between keeper and SQL in a sleep or a wake: the row wins
                    os.close(fd)
                if fds:
                    await self.keeper.drop(rec.id)
                self.records[rec.id], self.chunks[rec.id] = rec, []
                if rec.owner_pid is not None:
                    self.watch_pid(rec.owner_pid)
                continue
            if len(fds) != len(sizes):
                log.error("lease %s: keeper holds %d of %d chunks; its memory is lost", rec.id, len(fds), len(sizes))
                for fd in fds:
                    os.close(fd)
                self.records[rec.id] = rec
                self.chunks[rec.id] = []
                await self.apply(rec, LeaseEvent.FORCE_RECLAIM, "memory_lost")
                continue
            self.chunks[rec.id] = await self.backend_call(self.backend_of(rec.info).adopt, rec.info.gpu, fds, sizes)
            self.records[rec.id] = rec
            if rec.info.state == LeaseState.ACTIVE and rec.owner_pid is not None:
                self.watch_pid(rec.owner_pid)
        for key in [k for k in held if k.startswith(TIER_PREFIX)]:  # host tier copies: not leases (tier.py)
            self.kept_tier[key] = held.pop(key)
        for key, (_, fds) in held.items():  # memory the table does not know: a crash between keeper and SQL
            log.warning("keeper held unknown entry %s; dropping it", key)
            for fd in fds:
                os.close(fd)
            await self.keeper.drop(key)
        await self._load_gangs()
        await self.mirror.resync([r.info for r in self.records.values()])
        log.info("lease book loaded: %d live leases, %d gangs", len(self.records), len(self.gangs))

    async def _load_gangs(self) -> None:
        """The gangs, read back once every lease is (a gang whose leases were all lost with their memory ends)."""
        gangs, bad = await self.db.run(self.db.load_gangs, self.settings.node)
        await self._set_aside(bad)
        self.gangs = {g.gang_id: g for g in gangs}
        gone = ended(gangs, (r.info for r in self.records.values()))
        if gone:
            await self.persist([], drop_gangs=tuple(gone))
            for gang_id in gone:
                del self.gangs[gang_id]
            log.warning("gangs %s ended: none of their leases is left", gone)

    async def _set_aside(self, bad: list[BadRow]) -> None:
        """Rows that cannot be loaded, moved to the quarantine table (durably) and logged once each (quarantine.py)."""
        if not bad:
            return
        await self.db.run(self.db.set_aside, self.settings.node, bad, time.time())
        for item in bad:
            log.error("quarantined %s %s: %s (the row is in the quarantine table)", item.kind, item.key, item.reason)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._pidfds.values():
            loop.remove_reader(fd)
            os.close(fd)
        self._pidfds.clear()
        # Closing our fds does not free memory: the keeper still holds every live lease.
        for lease_id, chunks in self.chunks.items():
            rec = self.records.get(lease_id)
            await self.backend_call((self.backend_of(rec.info) if rec else self.backend).free, chunks)
        self._backend_pool.shutdown(wait=True)

    # ------------------------------------------------------------ owners

    def watch_pid(self, pid: int) -> None:
        """Fast path: the kernel tells us (pidfd readable) the moment an owner exits."""
        if pid in self._pidfds:
            return
        fd = open_pidfd(pid)
        if fd is None:
            return
        self._pidfds[pid] = fd
        asyncio.get_running_loop().add_reader(fd, self._pid_exited, pid)

    def _pid_exited(self, pid: int) -> None:
        self._unwatch(pid)
        if self.on_owner_exit is not None:
            self.on_owner_exit(pid)

    def _unwatch(self, pid: int) -> None:
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def forget_pid(self, pid: int) -> None:
        """A live process hung up (one of its connections closed) and owns no lease: its pidfd is closed, so the
        pidfds held are bounded by the open connections and the owners, not by every process that ever said hello.
        Watched again when it is granted a lease (`create`, the session's grants); the reconciler's pass checks
        every owner whatever is watched."""
        if pid in self._pidfds and not any(r.owner_pid == pid for r in self.records.values()):
            self._unwatch(pid)

    async def owner_exited(self, pid: int) -> None:
        async with self.lock:
            try:
                await self.apply_all([Move(rec, LeaseEvent.OWNER_LOST, "owner_exited") for rec in self.records.values()
                                      if rec.owner_pid == pid
                                      and rec.info.state in (LeaseState.ACTIVE, LeaseState.SLEEPING)
                                      and not self.owner_alive(rec)])
            except TableUnwritable as e:  # the reconciler's pass sees the dead owner again (invariant 8)
                log.warning("pid %d exited; its leases stay as they are for now: %s", pid, e)

    @staticmethod
    def owner_alive(rec: LeaseRecord) -> bool:
        return process_alive(rec.owner_pid, rec.owner_pid_start)

    # ------------------------------------------------------------ transitions

    def shareable(self, owner: str) -> list[LeaseRecord]:
        """The owner's committed weight and KV cache leases that still hold memory (a standby may shadow them:
        the weights to serve, the cache for the prefixes of the requests it would resume)."""
        return [r for r in self.records.values() if r.info.owner == owner and r.info.tag in SHAREABLE
                and r.info.state in LIVE and r.info.layout_hash is not None]

    def frozen_for_transfer(self, owner: str, token: str, cold_weights: bool = False) -> list[LeaseRecord]:
        """The owner's frozen leases, once the transfer token is proven for every one of them (`cold_weights`:
        check_complete's)."""
        recs = [r for r in self.records.values() if r.info.owner == owner and r.info.state == LeaseState.FROZEN]
        if not recs:
            if any(r.info.owner == owner and r.info.state in LIVE for r in self.records.values()):
                raise NotFrozenYet(f"{owner}'s leases are not frozen yet")
            raise NotFound(f"{owner} has no frozen leases")
        for rec in recs:
            if not same_token(rec.transfer_token, token):
                raise PermissionDenied("wrong transfer token")
        check_complete(owner, recs, cold_weights)
        return recs

    def get(self, lease_id: str) -> LeaseRecord:
        rec = self.records.get(lease_id)
        if rec is None:
            raise NotFound(f"no live lease {lease_id}")
        return rec

    async def apply(self, rec: LeaseRecord, event: LeaseEvent, cause: str, **changes: Any) -> None:
        """One transition of one lease. Caller holds `self.lock`."""
        await self.apply_all([Move(rec, event, cause, changes)])

    async def apply_all(self, moves: Sequence[Move], *, gangs: Sequence[Gang] = (), drop: Sequence[str] = ()) -> None:
        """The one place leases change state: every move checked against the table and staged on a copy,
        then all the rows written in one transaction, with the `gangs` given (new or changed), the end of every
        gang whose last lease these moves reclaim (invariant 6) and of those in `drop` (a gang a single engine took
        over degraded), then the copies become the live records. A refused move or a failed commit leaves every
        record and gang as it was. Caller holds `self.lock`."""
        now = time.time()
        staged: dict[str, LeaseRecord] = {}
        notes: list[tuple[LeaseInfo, LeaseState, str]] = []
        for move in moves:
            rec = staged.get(move.rec.id) or dataclasses.replace(move.rec)
            before = rec.info.state
            outcome = transition(before, move.event)
            update: dict[str, Any] = {"state": outcome.state, "last_seen": now}
            if outcome.bump_epoch:
                update["epoch"] = rec.info.epoch + 1
            if outcome.state == LeaseState.ACTIVE:
                update["deadline"] = None
            elif before != outcome.state and outcome.state in (LeaseState.ORPHANED, LeaseState.FROZEN):
                # the grace window starts when nobody holds the lease read-write any more (or a freeze restarts it)
                update["deadline"] = now + self.settings.grace_for(rec.info.engine_class)
            info_changes = {k: v for k, v in move.changes.items() if k in LeaseInfo.model_fields}
            rec.update(**update, **info_changes)
            for key, value in move.changes.items():
                if key not in LeaseInfo.model_fields:
                    setattr(rec, key, value)
            staged[rec.id] = rec
            if before != outcome.state or outcome.bump_epoch or info_changes:
                notes.append((rec.info, before, move.cause))
        put = {g.gang_id: g for g in gangs}
        after = {**self.gangs, **put}
        gone = tuple(ended(after.values(), (staged.get(i, r).info for i, r in self.records.items()))) if after else ()
        gone += tuple(g for g in drop if g in after and g not in gone)
        await self.persist(list(staged.values()), put_gangs=tuple(put.values()), drop_gangs=gone)
        self.gangs = {k: g for k, g in after.items() if k not in gone}
        freed = []
        for move in moves:  # the committed copies become the live records (callers keep their references)
            copy = staged.pop(move.rec.id, None)
            if copy is not None:
                for f in dataclasses.fields(copy):
                    setattr(move.rec, f.name, getattr(copy, f.name))
                if move.rec.info.state == LeaseState.RECLAIMED:
                    self.records.pop(move.rec.id, None)  # all gone at once: a listing sees the commit whole
                    freed.append(move.rec)
        for rec in freed:
            await self._free(rec)
        if gone:
            log.info("gangs %s ended with their last leases", list(gone))
        for info, before, cause in notes:
            self.mirror.lease_changed(info, before, cause)
        self.changed.set()
        self.changed = asyncio.Event()

    async def persist(self, records: list[LeaseRecord], put_gangs: tuple[Gang, ...] = (),
                      drop_gangs: tuple[str, ...] = ()) -> None:
        """Write rows (leases, gangs) in one transaction (durable when this returns)."""
        if not (records or put_gangs or drop_gangs):
            return
        await self.db.run(self.db.save, records, self.settings.node, put_gangs, drop_gangs)
        for rec in records:
            rec.tensors_dirty = False

    async def update(self, records: Sequence[LeaseRecord], change: Callable[[], None]) -> None:
        """`change()` edits `records` in place, then their rows are written; a refused write puts every record
        back as it was (invariant 8). Caller holds `self.lock`."""
        before = [(rec, dataclasses.replace(rec, tensors=dict(rec.tensors))) for rec in records]
        change()
        try:
            await self.persist(list(records))
        except Exception:
            for rec, old in before:
                for f in dataclasses.fields(old):
                    setattr(rec, f.name, getattr(old, f.name))
            raise

    async def _free(self, rec: LeaseRecord) -> None:
        self.records.pop(rec.id, None)
        chunks = self.chunks.pop(rec.id, [])
        await self.backend_call(self.backend_of(rec.info).free, chunks)
        with contextlib.suppress(Exception):  # the keeper may be restarting; load() drops unknown entries
            await self.keeper.drop(rec.id)
        log.info("lease %s reclaimed: %d bytes freed", rec.id, rec.info.size)

    async def create(self, *, owner: str, engine_class: str, uid: int, pid: int, pid_start: int | None,
                     gpu: int, size: int, tag: Tag, name: str, chunk_size: int | None, host: bool = False) -> LeaseRecord:
        self.backend.check_gpu(gpu)
        backend = self.host_backend if host else self.backend
        if self.board is not None and not (host and self.backend.name != "host"):
            self._check_board(gpu, size)
        gran = backend.granularity(gpu)
        chunk = round_up(chunk_size or self.settings.chunk_mib * 1024 * 1024, gran)
        size = round_up(size, gran)
        cap = self.settings.host_capacity_bytes
        if cap is not None and backend.name == "host":
            from libs.client.protocol import OutOfMemory

            used = sum(r.info.size for r in self.records.values() if r.info.state in LIVE)  # sleeping: no memory
            if used + size > cap:
                raise OutOfMemory(f"{size} bytes asked, {cap - used} of {cap} free")
        lease_id = new_id("lease")
        chunks = await self.backend_call(backend.allocate, gpu, chunk_sizes(size, chunk), lease_id)
        now = time.time()
        info = LeaseInfo(id=lease_id, node=self.settings.node, gpu=gpu, size=size, chunk_size=chunk, tag=tag,
                         name=name, owner=owner, engine_class=engine_class, epoch=1, state=LeaseState.ACTIVE,
                         created_at=now, last_seen=now, host=host)
        rec = LeaseRecord(info=info, owner_uid=uid, owner_pid=pid, owner_pid_start=pid_start)
        try:
            await self.persist([rec])  # durable first: a crash now leaves a row, no orphan memory
            await self.keeper.put(lease_id, [c.fd for c in chunks], {"gpu": gpu})
        except BaseException:
            await self.backend_call(backend.free, chunks)
            raise
        self.records[lease_id] = rec
        self.chunks[lease_id] = chunks
        self.watch_pid(pid)
        self.mirror.lease_changed(info, None, "allocated")
        return rec

    def _check_board(self, gpu: int, size: int) -> None:
        """A new lease only on a healthy GPU of this node, and (a simulated GPU, whose backend does not run out by
        itself) within its share of the host's memory."""
        assert self.board is not None
        entry = self.board.check_allocatable(gpu)
        if entry.simulated:
            room = self.board.room(gpu, (r.info for r in self.records.values()))
            if room is not None and size > room:
                from libs.client.protocol import OutOfMemory

                raise OutOfMemory(f"{size} bytes asked on GPU {gpu}, {max(0, room)} of {entry.total_bytes} free")

    async def gpu_failed(self, gpu: int, cause: str) -> list[str]:
        """Every live lease on a failed GPU is reclaimed: its memory is lost (a successor must cold-start from the
        weights file; the controller routes an open incident of their owner to the fallback on the reclaim)."""
        async with self.lock:
            # a host lease names the GPU it serves, but its memory is the host's: the fault does not take it
            hit = [r for r in self.records.values() if r.info.gpu == gpu and r.info.state in LIVE and not r.info.host]
            await self.apply_all([Move(r, LeaseEvent.FORCE_RECLAIM, cause) for r in hit])
        if hit:
            log.warning("GPU %d failed (%s): %d leases lost %s", gpu, cause, len(hit), [r.id for r in hit])
        return [r.id for r in hit]

    def backend_of(self, info: LeaseInfo) -> Backend:
        return self.host_backend if info.host else self.backend

    def fds_of(self, lease_id: str) -> list[int]:
        chunks = self.chunks.get(lease_id)
        if chunks is None:
            raise InvariantBroken(f"live lease {lease_id} has no memory")
        return [c.fd for c in chunks]

    # ------------------------------------------------------------ reconciler

    async def reconcile_once(self) -> int:
        async with self.lock:
            actions = reconciler.plan(list(self.records.values()), time.time(), self.owner_alive,
                                      list(self.gangs.values()))
            await self.apply_all([Move(self.records[lease_id], event, "reconciler") for lease_id, event in actions
                                  if lease_id in self.records])
            return len(actions)

    async def reconcile_forever(self) -> None:
        failing: TableUnwritable | None = None
        while True:
            await asyncio.sleep(self.settings.reconcile_interval_s)
            try:
                await self.reconcile_once()
            except TableUnwritable as e:  # nothing moved: the next pass plans it again (invariant 8)
                if failing is None:
                    log.warning("reconciler: %s; retrying every pass", e)
                failing = e
                continue
            if failing is not None:
                log.info("reconciler: the lease table is written again")
                failing = None
