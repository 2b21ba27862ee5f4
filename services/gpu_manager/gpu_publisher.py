"""The node's GPUs published: `gpus/<node>/<gpu>` (GpuRecord) in etcd for placement, and a `node.gpu.health` event
when a GPU's health changes (and once per GPU at start, so that subscribers learn the inventory); the
`gpu_health` command (SetGpuHealth) that marks a GPU, durably (db `gpu_health`), and `restore()`, which reads the
marks back at start (gpu_board.py invariant 4).

Off the critical path: records are recomputed every `interval_s` from the lease table and written only when they
changed (a lease's allocate or reclaim shows within one interval); a health change is written at once.

The first pass that writes also deletes this node's records of GPUs it does not have (`gone_gpu_keys`): a node that
comes back under the same name with fewer GPUs would otherwise keep the vanished ones' records for ever, and
placement would send engines there. Only keys under `gpus/<this node>/` are read or deleted; a pass whose read or
delete fails (etcd briefly away) is retried by the next, like the writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from libs.common.bus import Bus
from libs.common.events import GpuHealth, GpuRecord, SetGpuHealth, SetGpuHealthReply
from libs.common.store import Store
from services.gpu_manager.gpu_board import same_record
from services.gpu_manager.manager import LeaseBook

log = logging.getLogger("holdfast.gpu_manager.gpus")


def gone_gpu_keys(node: str, keys: Iterable[str], have: Iterable[int]) -> list[str]:
    """The keys of `node`'s GPU records (`gpus/<node>/<index>`) of GPUs not in `have`: what a manager that no longer
    has those GPUs deletes. Keys of another node, or not of a GPU index, are never named."""
    prefix, kept = f"gpus/{node}/", set(have)
    gone = []
    for key in keys:
        index = key.removeprefix(prefix)
        if key.startswith(prefix) and index.isdecimal() and int(index) not in kept:
            gone.append(key)
    return sorted(gone)


class GpuPublisher:
    def __init__(self, book: LeaseBook, bus: Bus, store: Store, interval_s: float = 0.5,
                 copies: Callable[[], dict[str, str]] | None = None) -> None:
        assert book.board is not None
        self.book = book
        self.board = book.board
        self.bus = bus
        self.store = store
        self.interval_s = interval_s
        self.written: dict[int, GpuRecord] = {}
        self.copies = copies  # the node's weight copies (restore.py `listing`), in every record for placement
        self._writing = asyncio.Lock()  # one writer at a time: an older record never lands after a newer one
        self._marking = asyncio.Lock()  # one mark at a time: the table and the board agree on the last one
        self.swept = False  # the records of GPUs this node no longer has deleted (once per start: none come back)

    def current(self) -> dict[int, GpuRecord]:
        recs = self.board.records((r.info for r in self.book.records.values()), time.time())
        if self.copies is not None:
            try:
                copies = self.copies()
            except OSError as e:  # an unreadable artifact dir: published without its copies, said once a pass
                log.warning("weight copies not listed: %r", e)
                copies = {}
            recs = {i: r.model_copy(update={"copies": copies}) for i, r in recs.items()}
        return recs

    async def publish_changed(self) -> None:
        async with self._writing:
            recs = self.current()
            for index, rec in recs.items():
                if same_record(self.written.get(index), rec):
                    continue
                await self.store.put(f"gpus/{rec.node}/{index}", rec.model_dump(mode="json"))
                self.written[index] = rec
            if not self.swept:
                await self._forget_gone(recs)
                self.swept = True

    async def _forget_gone(self, recs: dict[int, GpuRecord]) -> None:
        """Delete this node's records of GPUs it does not have (after its own are written). Idempotent: a key already
        gone deletes nothing."""
        node = self.board.node
        for key in gone_gpu_keys(node, await self.store.get_prefix(f"gpus/{node}/"), recs):
            await self.store.delete(key)
            log.warning("%s deleted: this node has no GPU %s now (its GPUs: %s)", key, key.rsplit("/", 1)[1],
                        sorted(recs))

    async def run(self) -> None:
        inventory = asyncio.ensure_future(self._inventory(self.current()))  # beside the records, not before them
        try:
            while True:
                try:
                    await self.publish_changed()
                except Exception as e:  # noqa: BLE001 - etcd briefly away: the next pass writes what changed
                    log.warning("GPU records not written (%r); retrying", e)
                await asyncio.sleep(self.interval_s)
        finally:
            inventory.cancel()

    async def _inventory(self, recs: dict[int, GpuRecord]) -> None:
        """Each GPU's event, once: a subscriber learns its UUID and capacity. Retried until stored: a manager that
        starts before the control plane made the event stream (or while NATS restarts) stopped on its first one."""
        for rec in recs.values():
            try:
                await self.bus.emit_until_stored(self._event(rec))
            except Exception as e:  # noqa: BLE001 - the record in etcd says the same; the event is for subscribers
                log.warning("GPU %d's inventory event not stored (%r); its record is in etcd", rec.gpu, e)

    async def restore(self) -> None:
        """At start, before any engine or command is served: the failed GPUs read back, and any lease still live on
        one (the manager died after the durable mark, before the reclaim's commit) reclaimed now."""
        db = self.book.db
        gone = self.board.restore(await db.run(db.load_gpu_health, self.board.node))
        if gone:
            log.warning("GPUs %s were marked failed but are not on this node now; their marks are kept", gone)
        for index, why in sorted(self.board.unhealthy.items()):
            log.warning("GPU %d is still failed (%s): no lease goes there until it is marked healthy", index, why)
            await self.book.gpu_failed(index, f"gpu_fault: {why}")

    async def set_health(self, cmd: SetGpuHealth) -> SetGpuHealthReply:
        """Idempotent: a repeated mark (an agent retrying a report whose reply it lost) changes nothing more. The
        board is never healthier than the table: an unhealthy mark refuses new leases at once, then is written; a
        healthy one is written first. Both are durable before the leases are reclaimed and before the reply."""
        async with self._marking:
            gpu = self.board.entry(cmd.gpu)
            changed = False if cmd.healthy else self.board.mark(gpu.index, False, cmd.detail)[1]
            why = None if cmd.healthy else self.board.unhealthy[gpu.index]
            db = self.book.db
            await db.run(db.save_gpu_health, self.board.node, gpu.uuid, gpu.index, why, time.time())
            if cmd.healthy:
                changed = self.board.mark(gpu.index, True, cmd.detail)[1]
            # Reclaimed on every unhealthy mark, changed or not: a lease allocated in between must not stay live.
            lost = [] if cmd.healthy else await self.book.gpu_failed(gpu.index, f"gpu_fault: {cmd.detail}")
        rec = self.current()[gpu.index]
        if changed or lost:
            log.warning("GPU %d (%s) marked %s: %s", gpu.index, gpu.uuid, "healthy" if cmd.healthy else "unhealthy",
                        cmd.detail)
            await self.bus.emit(self._event(rec, lost))
        await self.publish_changed()  # in etcd before the reply: placement must not pick it meanwhile
        return SetGpuHealthReply(gpu=rec, lost_leases=lost)

    @staticmethod
    def _event(rec: GpuRecord, lost: list[str] | None = None) -> GpuHealth:
        return GpuHealth(gpu=rec.gpu, healthy=rec.healthy, detail=rec.detail, node=rec.node, uuid=rec.uuid,
                         total_bytes=rec.total_bytes, leased_bytes=rec.leased_bytes, lost_leases=lost or [])
