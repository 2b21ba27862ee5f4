"""The peer source of a restore, applied to the lease book (the rules are peer.py's, pure): the digests recorded of
live leases, a peer picked and held under the book's lock, the new lease allocated and filled from it (host: memfd
to memfd; cuda: device to device, peer_cuda.py), and the look at the peer again after the copy. A copy that fails
reclaims the new lease and says why: restore.py then tries the next source."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from libs.common.events import Tag
from services.gpu_manager.artifact import Manifest, plan_blocks
from services.gpu_manager.manager import LeaseBook
from services.gpu_manager.peer import (
    Candidate,
    Digest,
    HeldHost,
    PeerLost,
    candidate,
    copy_host,
    neutral_layout,
    pick,
    still_same,
    wait_at_gate,
)
from services.gpu_manager.records import LeaseRecord

Allocator = Callable[[int, Tag, str], Awaitable[LeaseRecord]]
MapLive = Callable[..., Awaitable[tuple[LeaseRecord, Any]]]  # WeightCopies._map_live
Discard = Callable[[LeaseRecord, BaseException], Awaitable[None]]  # WeightCopies._discard

log = logging.getLogger("holdfast.gpu_manager.peer")


class PeerCopies:
    def __init__(self, book: LeaseBook, workers: int, gate: str, map_live: MapLive, discard: Discard) -> None:
        self.book = book
        self.workers = workers
        self.gate = gate  # tests only (settings.peer_gate)
        self.map_live = map_live
        self.discard = discard
        self.cuda = book.backend.name == "cuda"
        self.digests: dict[str, Digest] = {}  # lease id -> its content as hashed (peer.py, "Identity")
        # lease id -> (its commit's layout hash, its neutral layout): hashed again only after another commit (the
        # records are listed every gpu_publish_interval_s for the GPU records' `copies`)
        self._layouts: dict[str, tuple[str, str]] = {}

    def record(self, lease_id: str, man: Manifest) -> None:
        """`lease_id` holds `man`'s bytes (written from it, or filled from a copy of it): its digest."""
        self.digests[lease_id] = Digest.of(man)

    def healthy(self, gpu: int) -> bool:
        board = self.book.board
        return board is None or gpu not in board.unhealthy

    def candidates(self) -> list[Candidate]:
        """Every live lease as the pick sees it (on the loop; digests of leases gone are forgotten here)."""
        recs = self.book.records
        self.digests = {k: d for k, d in self.digests.items() if k in recs}
        self._layouts = {k: v for k, v in self._layouts.items() if k in recs}
        return [candidate(r, healthy=self.healthy(r.info.gpu), digest=self.digests.get(r.id), gpu_backend=self.cuda,
                          layout=self._layout(r)) for r in recs.values()]

    def _layout(self, rec: LeaseRecord) -> str | None:
        committed = rec.info.layout_hash
        if committed is None:
            return None
        got = self._layouts.get(rec.id)
        if got is None or got[0] != committed:
            got = self._layouts[rec.id] = (committed, neutral_layout(rec.tensors.values()))
        return got[1]

    def names(self, reference: Callable[[str], Manifest | None]) -> set[str]:
        """The copy names a peer could serve now (for the GPU records' `copies`): no requester, any GPU."""
        cands = self.candidates()
        out = set()
        for name in {c.name for c in cands if c.digest is not None}:
            if pick(cands, name=name, requester="", gpu=-1, reference=reference(name))[0] is not None:
                out.add(name)
        return out

    async def take(self, name: str, reference: Manifest | None, requester: str,
                   gpu: int) -> tuple[Candidate | None, Any, list[str]]:
        """(the peer, its memory held, why others were passed): picked and held under the book's lock (peer.py,
        invariant 1), so no reclaim falls between the pick and the hold."""
        async with self.book.lock:
            c, passed = pick(self.candidates(), name=name, requester=requester, gpu=gpu, reference=reference)
            if c is None:
                return None, None, passed
            chunks = list(self.book.chunks[c.lease_id])
            if self.cuda:
                from services.gpu_manager.peer_cuda import PeerMapping

                held: Any = await asyncio.to_thread(PeerMapping, c.gpu, chunks, gpu)
            else:
                held = HeldHost([os.dup(ch.fd) for ch in chunks], [ch.size for ch in chunks])
        return c, held, passed

    def fill(self, window: Any, c: Candidate, held: Any) -> float:
        """Copy every block (blocking; peer.py invariant 2); the seconds it took."""
        assert c.digest is not None
        man = c.digest.manifest
        if self.cuda:
            from services.gpu_manager.peer_cuda import copy_cuda

            return copy_cuda(window, held, plan_blocks(man.size, man.block_bytes, man.file_bytes))
        return copy_host(window, held, man, workers=self.workers)

    async def lost(self, c: Candidate) -> str | None:
        """Why the copy does not count, looked at under the lock (peer.py invariant 3); None: it counts."""
        async with self.book.lock:
            return still_same(c, self.book.records.get(c.lease_id), healthy=self.healthy(c.gpu))

    @staticmethod
    def release(held: Any) -> None:
        held.close()

    async def restore(self, name: str, reference: Manifest | None, requester: str, gpu: int, allocate: Allocator,
                      passed: list[str]) -> tuple[LeaseRecord, Candidate, float] | None:
        """(a new lease copied from a peer, the peer, the copy's seconds), or None with the reason in `passed`: no
        peer, or its copy failed (the new lease reclaimed). An allocation refused is raised: every source needs one."""
        c, held, why = await self.take(name, reference, requester, gpu)
        passed.extend(why)
        if c is None:
            return None
        assert c.digest is not None
        man = c.digest.manifest
        rec: LeaseRecord | None = None
        window = None
        try:
            rec = await allocate(man.size, Tag(man.tag), man.lease_name)
            _, window = await self.map_live(rec.id, committed=False, block_bytes=man.block_bytes)
            await asyncio.to_thread(wait_at_gate, self.gate)
            seconds = await asyncio.to_thread(self.fill, window, c, held)
            lost = await self.lost(c)
            if lost is not None:
                raise PeerLost(lost)
        except Exception as e:  # noqa: BLE001 - a peer's copy failing: the next source serves
            if rec is None:
                raise
            passed.append(f"peer {c.lease_id} on GPU {c.gpu}: {e}")
            log.warning("restore of %s from peer %s failed (%s): trying the next source", name, c.lease_id, e)
            await self.discard(rec, e)
            return None
        except BaseException as e:  # cancelled: no lease left behind either (restore.py's invariant)
            if rec is not None:
                await self.discard(rec, e)
            raise
        finally:
            if window is not None:
                await asyncio.to_thread(window.close)
            await asyncio.to_thread(self.release, held)
        return rec, c, seconds
