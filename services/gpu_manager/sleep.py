"""KV sleep/wake (issue 21): a live engine's leases give their physical memory back while the engine keeps its
address reservation, and get new memory at the same addresses on wake.

- `sleep(leases)` (engine socket): each lease must be the caller's, ACTIVE, at its epoch. A weights lease is first
  copied where a wake can fill it from (the host tier if it has room, else the artifact; an existing copy written
  from this very lease is reused). Then ACTIVE -> SLEEPING (durable), and the manager's side of the memory is
  freed: its fds and handles closed, the keeper's entry dropped. The engine unmaps its pages after the reply
  (host: PROT_NONE over the range; cuda: cuMemUnmap + cuMemRelease, the VA kept): then the memory is gone.
- `wake(leases)`: new chunks (the allocate path's backend, its capacity checked), a weights lease filled from its
  copy before anyone sees it, the keeper given the fds, then SLEEPING -> ACTIVE (durable, same epoch: the same
  holder), and the fds handed to the engine, which maps them at its kept addresses.
- `ask(engine, level | wake)` (node command): the control plane's request reaches the engine in its next
  heartbeat's reply; the engine quiesces, sends sleep/wake, then `answer`s. The command replies with what the
  engine did, the bytes released and the device's free memory before and after (cuda).

Invariants:
1. A SLEEPING lease has no chunks in the manager and no keeper entry; its row is durable before anything is freed,
   and a woken lease's memory is in the keeper before its row says ACTIVE (a crash in between leaves a SLEEPING
   row whose keeper entry `load` drops).
2. A weights lease sleeps only once a copy that restores its exact bytes exists; its root hash is kept in the
   sleeping row (`wake_copy`): a copy of that root serves its wake, whichever lease wrote it, and none of other
   bytes replaces it meanwhile (`Conflict`). A wake hands its fds out only after the whole copy was read into them
   (and, from disk, matched its hashes).
3. At most one ask per engine is outstanding; an ask is handed out once, and ends by the engine's answer or the
   command's timeout.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from libs.client.protocol import Ask, OutOfMemory, SleepReply, SleepReq, WakeReq
from libs.common.errors import (
    CommandTimeout,
    Conflict,
    HoldfastError,
    NotFound,
    PermissionDenied,
    RemoteError,
    StaleEpoch,
)
from libs.common.events import LeaseState, SleepEngine, SleepEngineReply, Tag
from services.gpu_manager.backends import Chunk
from services.gpu_manager.fsm import HELD, LIVE, LeaseEvent
from services.gpu_manager.manager import LeaseBook, Move
from services.gpu_manager.records import LeaseRecord
from services.gpu_manager.restore import WeightCopies
from services.gpu_manager.scope import lease_for

log = logging.getLogger("holdfast.gpu_manager.sleep")


@dataclass
class PendingAsk:
    ask: Ask
    engine_id: str
    done: asyncio.Future[None]
    handed: bool = False
    lease_ids: list[str] = field(default_factory=list)
    bytes: int = 0
    weights_source: str | None = None


def resident_bytes(recs: Any, gpu: int | None = None) -> int:
    """Bytes backed by memory now (a sleeping lease holds none), of one GPU or all."""
    return sum(r.info.size for r in recs if r.info.state in LIVE and (gpu is None or r.info.gpu == gpu))


class Sleeper:
    def __init__(self, book: LeaseBook, copies: WeightCopies) -> None:
        self.book = book
        self.copies = copies
        self.asks: dict[str, PendingAsk] = {}  # engine id -> its outstanding ask

    # ------------------------------------------------------------ the engine's requests (socket)

    def _mine(self, epochs: dict[str, int], engine_id: str, uid: int, pid: int, state: LeaseState) -> list[LeaseRecord]:
        recs = []
        for lease_id, epoch in epochs.items():
            rec = lease_for(self.book.records, lease_id, asker=engine_id, uid=uid, pid=pid)  # another uid's: unknown
            if rec.info.owner != engine_id:
                raise PermissionDenied(f"lease {lease_id} is not held by {engine_id}")
            if epoch != rec.info.epoch:
                raise StaleEpoch(f"lease {lease_id} is at epoch {rec.info.epoch}, request carries {epoch}")
            if rec.owner_pid != pid:
                raise PermissionDenied(f"lease {lease_id} is not attached by pid {pid}")
            if rec.info.state != state:
                raise Conflict(f"lease {lease_id} is {rec.info.state.value}, not {state.value}")
            if rec.info.layout_hash is None:
                raise Conflict(f"lease {lease_id} is not committed: commit before sleeping")
            recs.append(rec)
        return recs

    async def sleep(self, req: SleepReq, engine_id: str, uid: int, pid: int) -> SleepReply:
        async with self.book.lock:
            recs = self._mine(req.epochs, engine_id, uid, pid, LeaseState.ACTIVE)
        roots = {}
        for rec in recs:  # invariant 2; off the lock (seconds for large weights), checked again below
            if rec.info.tag == Tag.WEIGHTS:
                roots[rec.id] = await self.copies.keep_for_wake(rec)
        async with self.book.lock:
            recs = self._mine(req.epochs, engine_id, uid, pid, LeaseState.ACTIVE)
            for rec in recs:
                rec.update(wake_copy=roots.get(rec.id))  # durable with the SLEEP below (invariant 2)
            await self.book.apply_all([Move(r, LeaseEvent.SLEEP, "asleep") for r in recs])
            freed = 0
            for rec in recs:  # invariant 1: the row first, then the memory
                chunks, self.book.chunks[rec.id] = self.book.chunks.get(rec.id, []), []
                await self.book.backend_call(self.book.backend.free, chunks)
                try:
                    await self.book.keeper.drop(rec.id)
                except Exception as e:  # noqa: BLE001 - load() drops a sleeping lease's leftover entry
                    log.warning("keeper entry of sleeping lease %s not dropped now: %r", rec.id, e)
                freed += rec.info.size
        self._note(req.ask, engine_id, recs, freed)
        log.info("%s sleeps: %d leases, %d bytes released %s", engine_id, len(recs), freed, [r.id for r in recs])
        return SleepReply(lease_ids=[r.id for r in recs], bytes=freed)

    async def wake(self, req: WakeReq, engine_id: str, uid: int, pid: int) -> tuple[list[LeaseRecord], str | None]:
        async with self.book.lock:
            recs = self._mine(req.epochs, engine_id, uid, pid, LeaseState.SLEEPING)
            self._check_room(recs)
        new: dict[str, list[Chunk]] = {}
        source = None
        try:
            for rec in recs:
                new[rec.id] = await self.book.backend_call(self.book.backend.allocate, rec.info.gpu,
                                                           _sizes(rec), f"{rec.id}-w")
                if rec.info.tag == Tag.WEIGHTS:
                    source = await self.copies.fill_for_wake(rec, new[rec.id])
            async with self.book.lock:
                recs = self._mine(req.epochs, engine_id, uid, pid, LeaseState.SLEEPING)
                for rec in recs:  # invariant 1: in the keeper before the row says ACTIVE
                    await self.book.keeper.put(rec.id, [c.fd for c in new[rec.id]], {"gpu": rec.info.gpu})
                for rec in recs:
                    rec.update(wake_copy=None)
                await self.book.apply_all([Move(r, LeaseEvent.WAKE, "woken") for r in recs])
                for rec in recs:
                    self.book.chunks[rec.id] = new.pop(rec.id)
        finally:
            for lease_id, chunks in new.items():  # not handed on: a failure before the wake was durable
                await self.book.backend_call(self.book.backend.free, chunks)
                await _quietly(self.book.keeper.drop(lease_id))
        self._note(req.ask, engine_id, recs, sum(r.info.size for r in recs), source)
        log.info("%s wakes: %d leases, %d bytes mapped again%s", engine_id, len(recs), sum(r.info.size for r in recs),
                 f", weights from {source}" if source else "")
        return recs, source

    def _check_room(self, recs: list[LeaseRecord]) -> None:
        """A wake takes memory like an allocate: refused on a GPU marked unhealthy (`GpuUnhealthy`: a failed GPU's
        mark leaves sleeping leases asleep, they hold no memory) and past the GPU's capacity (someone took it
        meanwhile)."""
        backend, live = self.book.backend, list(self.book.records.values())
        for gpu in {r.info.gpu for r in recs}:
            if self.book.board is not None:
                self.book.board.check_allocatable(gpu)
            want = sum(r.info.size for r in recs if r.info.gpu == gpu)
            if backend.name == "host":
                used, cap = resident_bytes(live), self.book.settings.host_capacity_bytes or backend.capacity(gpu)
            else:
                used, cap = resident_bytes(live, gpu), backend.capacity(gpu)
            if used + want > cap:
                raise OutOfMemory(f"waking needs {want} bytes on GPU {gpu}, {max(0, cap - used)} of {cap} free")

    def _note(self, ask_id: str | None, engine_id: str, recs: list[LeaseRecord], nbytes: int,
              source: str | None = None) -> None:
        pending = self.asks.get(engine_id)
        if ask_id is None or pending is None or pending.ask.id != ask_id:
            return
        pending.lease_ids += [r.id for r in recs]
        pending.bytes += nbytes
        pending.weights_source = source or pending.weights_source

    # ------------------------------------------------------------ asks (node command -> heartbeat -> answer)

    def ask_for(self, engine_id: str, pid: int) -> Ask | None:
        """The ask to hand this engine in its heartbeat's reply, once (invariant 3)."""
        pending = self.asks.get(engine_id)
        if pending is None or pending.handed:
            return None
        if not any(r.info.owner == engine_id and r.owner_pid == pid for r in self.book.records.values()):
            return None  # another process of the same id: not the one holding the leases
        pending.handed = True
        return pending.ask

    def answer(self, ask_id: str, engine_id: str, error: dict[str, str] | None) -> None:
        pending = self.asks.get(engine_id)
        if pending is None or pending.ask.id != ask_id:
            raise NotFound(f"no outstanding ask {ask_id} for {engine_id}")
        if not pending.done.done():
            if error:
                pending.done.set_exception(RemoteError(error.get("code", "error"), error.get("message", "")))
            else:
                pending.done.set_result(None)

    async def ask(self, cmd: SleepEngine) -> SleepEngineReply:
        held = [r for r in self.book.records.values() if r.info.owner == cmd.engine_id and r.info.state in HELD]
        if not held:
            raise NotFound(f"{cmd.engine_id} holds no leases on {self.book.settings.node}")
        asleep = any(r.info.state == LeaseState.SLEEPING for r in held)
        if cmd.wake and not asleep:
            raise Conflict(f"{cmd.engine_id} is not asleep")
        if not cmd.wake and asleep:
            raise Conflict(f"{cmd.engine_id} is asleep already: wake it first")
        if not cmd.wake and any(r.info.state != LeaseState.ACTIVE for r in held):
            raise Conflict(f"{cmd.engine_id}'s leases are not all active (an incident is under way)")
        if cmd.engine_id in self.asks:
            raise Conflict(f"{cmd.engine_id} has an ask outstanding ({self.asks[cmd.engine_id].ask.op})")
        ask = Ask(id=secrets.token_hex(8), op="wake" if cmd.wake else "sleep", level=cmd.level)
        pending = PendingAsk(ask, cmd.engine_id, asyncio.get_running_loop().create_future())
        gpus = sorted({r.info.gpu for r in held})
        before = await self._free_bytes(gpus)
        t0 = time.perf_counter()
        self.asks[cmd.engine_id] = pending
        try:
            await asyncio.wait_for(asyncio.shield(pending.done), cmd.timeout_s)
        except TimeoutError:
            raise CommandTimeout(f"{cmd.engine_id} did not {ask.op} within {cmd.timeout_s} s "
                                 f"({'it never heartbeated' if not pending.handed else 'it took the ask'})") from None
        finally:
            del self.asks[cmd.engine_id]
        seconds = time.perf_counter() - t0
        after = await self._free_bytes(gpus)
        return SleepEngineReply(engine_id=cmd.engine_id, state="awake" if cmd.wake else "sleeping", level=cmd.level,
                                lease_ids=pending.lease_ids, bytes=pending.bytes, seconds=round(seconds, 4),
                                free_bytes_before=before, free_bytes_after=after, weights_source=pending.weights_source)

    async def _free_bytes(self, gpus: list[int]) -> int | None:
        """The device's free memory (cuda: cuMemGetInfo, what NVML reports less the driver's reserve)."""
        if self.book.backend.name != "cuda":
            return None
        total = 0
        for gpu in gpus:
            total += int(await self.book.backend_call(self.book.backend.free_bytes, gpu) or 0)
        return total


def _sizes(rec: LeaseRecord) -> list[int]:
    from libs.client.protocol import chunk_sizes

    return chunk_sizes(rec.info.size, rec.info.chunk_size)


async def _quietly(coro: Any) -> None:
    try:
        await coro
    except (HoldfastError, OSError, ConnectionError) as e:
        log.warning("cleanup after a failed wake: %r", e)
