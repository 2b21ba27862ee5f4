"""Copies of a lease's weights that outlive the GPU memory: artifacts on disk and the host tier, written from a
committed lease and restored into a new lease for a cold-starting engine (issue 21; docs/restore.md).

- `snapshot(lease)`: the lease is mapped into this process under the book's lock (a reclaim after that cannot
  pull the pages away), then written block by block on many threads without the lock (engines keep being
  served); the artifact appears under its name only once whole (artifact.py, invariant 2).
- `restore(name)`: a new lease for the caller (the allocate path, with its limits), filled from the fastest
  source: a peer (a live lease of another engine on this node with the same content, copied GPU to GPU: peer.py,
  restore_peer.py), else the host tier's copy if this node keeps one, else the artifact with every block's hash
  checked; then the tensors the copy was written with are registered on it. A failed fill reclaims the new lease
  and says why; a failed peer copy falls back to the next source (the reply's `passed` says why).
- Policy (settings): once an engine of a class in `snapshot_classes` commits its weights, they are written to
  their artifact if none is there yet; of a class in `host_tier_classes`, copied into the host tier.

On cuda a host tier copy is registered in place (cuMemHostRegister) when it is written, or adopted after a restart,
and DMA'd from there on every restore (host_tier_cuda.py): the write's reply says so (`tier_registered`,
`tier_register_s`), and a restore's `register_s` is 0. Where registering failed at the write, the first restore
tries again (its `register_s` then says what it cost), and where that fails too the copy goes through pinned
bounce buffers (`registered_dma` 0). `host_tier_pin` false: never registered, always the bounce buffers.

Invariant: a restored lease is handed out only after every block was read whole (and, from disk or a host-backend
peer, matched its hash); a restore that fails leaves no lease behind.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.client.direct_io import OpenFiles, default_workers, open_files
from libs.common.errors import Conflict, HoldfastError, NotFound, Unavailable
from libs.common.events import LeaseState, SnapshotReply, Tag
from services.gpu_manager.artifact import (
    FORMAT_VERSION,
    HASH,
    Manifest,
    artifact_path,
    check_name,
    default_name,
    file_names,
    plan_blocks,
    read_manifest,
    rebase,
    root_digest,
    write_manifest,
)
from services.gpu_manager.blockio import HostWindow, read_blocks, write_blocks
from services.gpu_manager.fsm import LIVE, LeaseEvent
from services.gpu_manager.manager import LeaseBook
from services.gpu_manager.peer import Candidate, hash_lease
from services.gpu_manager.records import LeaseRecord
from services.gpu_manager.restore_peer import PeerCopies
from services.gpu_manager.tier import HostTier

log = logging.getLogger("holdfast.gpu_manager.restore")

Allocator = Callable[[int, Tag, str], Awaitable[LeaseRecord]]


def gib_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / max(seconds, 1e-9) / 2**30, 3)


@dataclass(frozen=True)
class Fill:
    """How a lease was filled: the copy's seconds, whether its files were O_DIRECT, and the path (`in place`: host
    backend, reads into the lease's pages; `bounce`: cuda, through pinned buffers; `registered`: cuda, DMA from
    the host tier's own page-locked pages) with the seconds registering took in this fill."""

    seconds: float
    direct: bool
    path: str
    register_s: float = 0.0


@dataclass(frozen=True)
class Restored:
    """A restore's outcome: the new lease, the source that served, its figures, the peer it was copied from (a
    peer restore) and why faster sources were passed."""

    rec: LeaseRecord
    source: str
    stats: dict[str, float]
    peer: Candidate | None = None
    passed: tuple[str, ...] = ()


class WeightCopies:
    def __init__(self, book: LeaseBook, tier: HostTier) -> None:
        self.book = book
        self.settings = book.settings
        self.tier = tier
        self.root = self.settings.artifact_root()
        self.workers = self.settings.io_workers or default_workers()
        self.block_bytes = self.settings.artifact_block_bytes
        self.file_bytes = self.settings.artifact_file_bytes
        self._node_tag = re.sub(r"[^A-Za-z0-9_-]", "_", self.settings.node)
        if self.file_bytes % self.block_bytes:
            raise ValueError(f"artifact_file_bytes {self.file_bytes} is not a multiple of the block "
                             f"{self.block_bytes}")
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.policy_done: set[tuple[str, str]] = set()  # (what, name) the policy started already
        # live leases' digests and the peer source (restore_peer.py): it maps and discards as a restore here does
        self.peers = PeerCopies(book, self.workers, self.settings.peer_gate, self._map_live, self._discard)
        self.cuda = book.backend.name == "cuda"
        self.pinned: Any = None  # cuda: the tier's copies registered in place (host_tier_cuda.PinnedTier)
        if self.cuda and self.settings.host_tier_pin:
            from services.gpu_manager.host_tier_cuda import PinnedTier

            self.pinned = PinnedTier()
            tier.pinned_bytes = self.pinned.bytes
            if tier.entries:  # kept by the keeper through a restart: registered again before a cold start needs them
                self._spawn(self._pin_adopted(getattr(book.backend, "ordinals", [0])[0]), "pin-adopted")

    # ------------------------------------------------------------ windows

    def _window(self, gpu: int, chunks: list[Any], *, to_device: bool, block_bytes: int) -> Any:
        """The lease's memory mapped here (blocking: call off the loop)."""
        if self.book.backend.name == "cuda":
            from services.gpu_manager.restore_cuda import CudaWindow

            return CudaWindow(gpu, chunks, workers=self.workers, block_bytes=block_bytes, to_device=to_device)
        return HostWindow([c.fd for c in chunks], [c.size for c in chunks], read_only=not to_device)

    async def _map_live(self, lease_id: str, *, committed: bool, block_bytes: int) -> tuple[LeaseRecord, Any]:
        async with self.book.lock:
            rec = self.book.get(lease_id)
            if rec.info.state not in LIVE:
                raise Conflict(f"lease {lease_id} is {rec.info.state.value}")
            if committed and rec.info.layout_hash is None:
                raise Conflict(f"lease {lease_id} is not committed: its tensors may be half written")
            window = await asyncio.to_thread(self._window, rec.info.gpu, list(self.book.chunks[lease_id]),
                                             to_device=not committed, block_bytes=block_bytes)
            return rec, window

    # ------------------------------------------------------------ snapshot

    async def snapshot(self, lease_id: str, name: str | None = None, *, host_tier: bool = False,
                       artifact: bool = True) -> SnapshotReply:
        async with self.book.lock:
            size, default = self.book.get(lease_id).info.size, default_name(*self._class_and_name(lease_id))
        name = check_name(name or default)
        if host_tier:
            self.tier.room_for(name, size)  # refused before any byte is written (tier.py, invariant 1)
        rec, window = await self._map_live(lease_id, committed=True, block_bytes=self.block_bytes)
        lock = self._locks.setdefault(name, asyncio.Lock())
        pinned: float | None = None
        try:
            async with lock:
                man, path, direct = None, "", False
                try:
                    if artifact:
                        man, path, direct = await self._artifact(window, rec, name)
                    if host_tier:
                        man = await self._write_tier(window, rec, name)
                finally:
                    await asyncio.to_thread(window.close)  # the lease is not held while the copy is registered
                    window = None
                if host_tier:
                    pinned = await self._pin(name, rec.info.gpu)
        finally:
            if window is not None:
                await asyncio.to_thread(window.close)
        assert man is not None
        self.peers.record(lease_id, man)  # its bytes were hashed: a peer from now on (peer.py, "Identity")
        log.info("lease %s -> %s (%s%s): %d bytes in %.2f s (%.2f GiB/s, direct I/O %s)%s", lease_id, name,
                 path or "", " + host tier" if host_tier else "", man.size, man.write_s, gib_s(man.size, man.write_s),
                 direct, "" if pinned is None else f", registered in {pinned:.2f} s")
        return SnapshotReply(artifact=name, path=path, bytes=man.size, seconds=round(man.write_s, 4),
                             gib_s=gib_s(man.size, man.write_s), root_hash=man.root, direct_io=direct,
                             host_tier=host_tier, tier_registered=pinned is not None,
                             tier_register_s=round(pinned or 0.0, 4))

    def _class_and_name(self, lease_id: str) -> tuple[str, str]:
        info = self.book.get(lease_id).info
        return info.engine_class, info.name

    def _blocks(self, size: int) -> list[Any]:
        return plan_blocks(size, self.block_bytes, self.file_bytes)

    def _manifest(self, rec: LeaseRecord, name: str, digests: list[str], seconds: float) -> Manifest:
        size = rec.info.size
        return Manifest(version=FORMAT_VERSION, name=name, size=size, tag=rec.info.tag.value,
                        lease_name=rec.info.name, engine_class=rec.info.engine_class, source_lease=rec.id,
                        layout_hash=rec.info.layout_hash, tensors=list(rec.tensors.values()), block_bytes=self.block_bytes,
                        file_bytes=self.file_bytes, files=file_names(size, self.file_bytes), hash=HASH, blocks=digests,
                        root=root_digest(digests, size, self.block_bytes, self.file_bytes, list(rec.tensors.values())),
                        node=self.settings.node, created_at=time.time(), write_s=seconds)

    async def _artifact(self, window: Any, rec: LeaseRecord, name: str) -> tuple[Manifest, str, bool]:
        """The artifact written whole; a full disk is `unavailable` (the partial files removed, an older copy kept)."""
        try:
            return await asyncio.to_thread(self._write_artifact, window, rec, name)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise Unavailable(f"no room for artifact {name} in {self.root} ({e.strerror}): nothing written, "
                              "ask again once its disk has room") from e

    def _scratch(self, kind: str, name: str, token: str) -> Path:
        """A write's scratch directory (`partial`: the files being written; `old`: the copy being replaced), named
        for this node: what a SIGKILL mid-write leaves is this node's to sweep (`sweep_scratch`), and only this
        node's (an artifact directory may be shared by several nodes' managers)."""
        return self.root / f".{name}.{kind}-{self._node_tag}-{token}"

    def sweep_scratch(self) -> list[str]:
        """Remove what this node's writes killed mid-way left (a whole lease's bytes each, for good): at start,
        before any write of this manager's (blocking). The names removed."""
        if not self.root.is_dir():
            return []
        mine = re.compile(r"\..+\.(partial|old)-" + re.escape(self._node_tag) + r"-[0-9a-f]{8}")
        gone = [d.name for d in self.root.iterdir() if mine.fullmatch(d.name) and d.is_dir() and not d.is_symlink()]
        for dirname in gone:
            shutil.rmtree(self.root / dirname, ignore_errors=True)
            log.warning("removed %s: an artifact write of this node cut off mid-way (killed)", self.root / dirname)
        return gone

    def _write_artifact(self, window: Any, rec: LeaseRecord, name: str) -> tuple[Manifest, str, bool]:
        self.root.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(4)
        tmp = self._scratch("partial", name, token)
        tmp.mkdir()
        try:
            t0 = time.perf_counter()
            entries = file_names(rec.info.size, self.file_bytes)
            files = open_files([tmp / e.name for e in entries], write=True, direct=self.settings.direct_io,
                               sizes=[e.bytes for e in entries])
            try:
                digests = write_blocks(files, self._blocks(rec.info.size), window, workers=self.workers)
                for fd in files.fds:
                    os.fsync(fd)
            finally:
                files.close()
            man = self._manifest(rec, name, digests, time.perf_counter() - t0)
            write_manifest(tmp, man)  # the last write (artifact.py, invariant 2)
            final = artifact_path(self.root, name)
            old = self._scratch("old", name, token)
            self._spare_sleepers(name, man.root, lambda: read_manifest(final).root)
            if final.exists():
                os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            return man, str(final), files.direct
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    async def _write_tier(self, window: Any, rec: LeaseRecord, name: str) -> Manifest:
        entries = file_names(rec.info.size, self.file_bytes)
        self.tier.room_for(name, rec.info.size)
        fds = self.tier.make_files(name, [e.bytes for e in entries])
        try:
            def copy() -> Manifest:
                t0 = time.perf_counter()
                digests = write_blocks(OpenFiles(fds, direct=False, owned=False), self._blocks(rec.info.size), window,
                                       workers=self.workers)
                return self._manifest(rec, name, digests, time.perf_counter() - t0)

            man = await asyncio.to_thread(copy)
            held = self.tier.get(name)
            if held is not None:
                self._spare_sleepers(name, man.root, lambda: held.manifest.root)
            await self.tier.put(name, man, fds)
            await self._prune_pinned()  # a replaced copy's registration goes (host_tier_cuda.py, invariant 2)
            return man
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    # ------------------------------------------------------------ restore

    def _source(self, name: str, sources: list[str]) -> tuple[str, Manifest, Any]:
        """(which, manifest, what to read): the host tier's copy first, then the artifact (blocking)."""
        copy = self.tier.get(name) if "host" in sources else None
        if copy is not None:
            return "host", copy.manifest, [os.dup(fd) for fd in copy.fds]  # a tier drop meanwhile closes its own
        if "artifact" not in sources:
            raise NotFound(f"no host tier copy of {name} on {self.settings.node}")
        directory = artifact_path(self.root, name)
        return "artifact", read_manifest(directory), directory

    def _fill(self, window: Any, source: str, man: Manifest, where: Any) -> Fill:
        blocks = plan_blocks(man.size, man.block_bytes, man.file_bytes)
        if source == "host":
            if self.pinned is not None:
                served = self._dma_from_tier(window, man, where, blocks)
                if served is not None:
                    return served
            files = OpenFiles(where, direct=False)
            digests = None  # memory the keeper held since we wrote it: no disk or network in between
        else:
            files = open_files([where / e.name for e in man.files], write=False, direct=self.settings.direct_io)
            digests = man.blocks
        try:
            seconds = read_blocks(files, blocks, window, workers=self.workers, digests=digests,
                                  what=f"{source} copy of {man.name}")
        finally:
            files.close()
        return Fill(seconds, files.direct, "bounce" if self.cuda else "in place")

    def _dma_from_tier(self, window: Any, man: Manifest, fds: list[int], blocks: list[Any]) -> Fill | None:
        """The host tier's copy DMA'd from its own pages (registered now, or since an earlier restore); None where it
        cannot be registered: the caller reads it through bounce buffers (host_tier_cuda.py, invariant 3)."""
        from libs.client.cuda_driver import CudaError
        from services.gpu_manager.host_tier_cuda import dma_blocks

        try:
            copy, register_s = self.pinned.acquire(man, fds, window.ordinal)
        except (CudaError, OSError, HoldfastError) as e:
            log.warning("host tier copy %s could not be page-locked in place (%s): through bounce buffers", man.name, e)
            return None
        try:
            seconds = dma_blocks(window, copy, blocks)
        finally:
            self.pinned.release(copy)
            OpenFiles(fds, direct=False).close()  # our duplicates; the registration's mapping keeps the pages
        return Fill(seconds, False, "registered", register_s)

    async def _prune_pinned(self) -> None:
        if self.pinned is not None:
            live = {name: c.manifest for name, c in self.tier.entries.items()}
            await asyncio.to_thread(self.pinned.prune, live)

    async def _pin(self, name: str, ordinal: int) -> float | None:
        """Register the tier's copy `name` now (caller holds its name lock): the seconds it took, None where not (no
        registering on this backend or by the settings, the copy gone, or refused: its restores try again)."""
        copy = self.tier.get(name)
        if self.pinned is None or copy is None:
            return None
        fds = [os.dup(fd) for fd in copy.fds]  # on the loop: a replacing `put` closes the tier's own, not these
        try:
            return await asyncio.to_thread(self.pinned.pin, copy.manifest, fds, ordinal)
        finally:
            OpenFiles(fds, direct=False).close()

    async def _pin_adopted(self, ordinal: int) -> None:
        for name in sorted(self.tier.entries):
            async with self._locks.setdefault(name, asyncio.Lock()):
                took = await self._pin(name, ordinal)
            if took is not None:
                log.info("host tier copy %s (adopted) registered in %.2f s", name, took)

    async def restore(self, name: str, sources: list[str], allocate: Allocator, *, requester: str = "",
                      gpu: int = 0) -> Restored:
        """A new lease filled from the first source that serves, in the order peer, host, artifact (of those in
        `sources`): a peer that fails or changes under its copy is passed (`passed` says why), the next one tried."""
        t0 = time.perf_counter()
        name = check_name(name)
        passed: list[str] = []
        if "peer" in sources:
            reference = await asyncio.to_thread(self._reference, name)
            got = await self.peers.restore(name, reference, requester, gpu, allocate, passed)
            if got is not None:
                rec, c, seconds = got
                assert c.digest is not None
                return await self._finish(rec, name, "peer", c.digest.manifest, Fill(seconds, False, "peer"), t0,
                                          passed, peer=c)
            if not {"host", "artifact"} & set(sources):
                raise NotFound(f"no peer holds {name} on {self.settings.node}: {'; '.join(passed) or 'none'}")
        await self._prune_pinned()
        source, man, where = await asyncio.to_thread(self._source, name, sources)
        try:
            rec = await allocate(man.size, Tag(man.tag), man.lease_name)
        except BaseException:
            if source == "host":
                OpenFiles(where, direct=False).close()
            raise
        window = None
        try:
            _, window = await self._map_live(rec.id, committed=False, block_bytes=man.block_bytes)
            fill = await asyncio.to_thread(self._fill, window, source, man, where)
        except BaseException as e:
            if source == "host" and window is None:
                OpenFiles(where, direct=False).close()
            await self._discard(rec, e)
            raise
        finally:
            if window is not None:
                await asyncio.to_thread(window.close)
        return await self._finish(rec, name, source, man, fill, t0, passed)

    async def _finish(self, rec: LeaseRecord, name: str, source: str, man: Manifest, fill: Fill, t0: float,
                      passed: list[str], peer: Candidate | None = None) -> Restored:
        """The copy's tensors registered on the filled lease (its owner commits them), its digest recorded."""
        async with self.book.lock:
            if rec.info.state != LeaseState.ACTIVE or rec.id not in self.book.records:
                raise Conflict(f"restored lease {rec.id} is {rec.info.state.value}: its engine went away")

            def register() -> None:
                for meta in rebase(man.tensors, rec.id):
                    rec.set_tensor(meta)

            await self.book.update([rec], register)
            self.peers.record(rec.id, man)  # it holds the copy's bytes: every block read whole (and checked)
        stats = {"bytes": float(man.size), "fill_s": round(fill.seconds, 4),
                 "fill_gib_s": gib_s(man.size, fill.seconds), "total_s": round(time.perf_counter() - t0, 4),
                 "direct_io": float(fill.direct), "registered_dma": float(fill.path == "registered"),
                 "register_s": round(fill.register_s, 4)}
        if peer is not None:
            stats["peer_gpu"] = float(peer.gpu)
        log.info("restored %s from %s%s into %s (%s): %d bytes in %.3f s (%.2f GiB/s)", name, source,
                 f" (lease {peer.lease_id} on GPU {peer.gpu})" if peer else "", rec.id, fill.path, man.size,
                 fill.seconds, stats["fill_gib_s"])
        return Restored(rec, source, stats, peer, tuple(passed))

    def _reference(self, name: str) -> Manifest | None:
        """The node's own copy of `name` a peer must match (the host tier's, else the artifact's), or None
        (blocking: reads a manifest). An unreadable artifact is no reference: it is refused on its own later."""
        copy = self.tier.get(name)
        if copy is not None:
            return copy.manifest
        try:
            return read_manifest(artifact_path(self.root, name))
        except (HoldfastError, OSError):
            return None

    async def digest(self, lease_id: str) -> None:
        """Hash a committed weights lease's blocks, so it can serve as a peer (`peer_classes`)."""
        rec, window = await self._map_live(lease_id, committed=True, block_bytes=self.block_bytes)
        try:
            t0 = time.perf_counter()
            digests = await asyncio.to_thread(hash_lease, window, rec.info.size, self.block_bytes, self.file_bytes,
                                              workers=self.workers)
        finally:
            await asyncio.to_thread(window.close)
        man = self._manifest(rec, default_name(rec.info.engine_class, rec.info.name), digests,
                             time.perf_counter() - t0)
        self.peers.record(lease_id, man)
        log.info("lease %s hashed for peer restores in %.3f s", lease_id, man.write_s)

    async def _discard(self, rec: LeaseRecord, why: BaseException) -> None:
        log.warning("restore into %s failed (%r): reclaiming it", rec.id, why)
        async with self.book.lock:
            if rec.id in self.book.records:
                await self.book.apply(rec, LeaseEvent.FORCE_RECLAIM, "restore failed")

    def listing(self) -> dict[str, str]:
        """This node's copies, name -> "peer", "host" or "artifact" (the closest wins: the faster restore), as
        published in each GPU record for placement (blocking: a directory listing). A peer is judged against the
        host tier's copy where there is one (the artifact's manifest is not read here)."""
        out = {}
        if self.root.is_dir():
            out = {d.name: "artifact" for d in self.root.iterdir()
                   if not d.name.startswith(".") and (d / "manifest.json").is_file()}
        out.update({name: "host" for name in self.tier.entries})
        out.update({name: "peer" for name in self.peers.names(self._tier_manifest)})
        return out

    def _tier_manifest(self, name: str) -> Manifest | None:
        copy = self.tier.get(name)
        return None if copy is None else copy.manifest

    # ------------------------------------------------------------ sleep/wake of a weights lease (sleep.py)

    def _copy_of(self, rec: LeaseRecord) -> tuple[str, str | None, Manifest | None]:
        """(name, where a copy restoring this lease's bytes is: host, artifact or None, its manifest). Asleep, any
        copy of the root it slept with (`wake_copy`: another lease of the same bytes and tensors may have written it
        since); awake, one written from this very lease at its committed layout."""
        name = default_name(rec.info.engine_class, rec.info.name)

        def same(man: Manifest) -> bool:
            if rec.info.wake_copy is not None:
                return man.root == rec.info.wake_copy and man.size == rec.info.size
            return man.source_lease == rec.id and man.layout_hash == rec.info.layout_hash and man.size == rec.info.size

        copy = self.tier.get(name)
        if copy is not None and same(copy.manifest):
            return name, "host", copy.manifest
        try:
            man = read_manifest(artifact_path(self.root, name))
            if same(man):
                return name, "artifact", man
        except (NotFound, HoldfastError, OSError):
            pass
        return name, None, None

    def _spare_sleepers(self, name: str, new_root: str, old_root: Callable[[], str]) -> None:
        """Conflict where the copy `name` holds (`old_root()`) is what a sleeping lease wakes from and the bytes
        replacing it are other ones: its memory is gone, it could never wake (a second engine of its class slept,
        or a bystander's snapshot, and the first engine was stranded for good). Blocking; read-only of the book."""
        sleepers = [r for r in list(self.book.records.values()) if r.info.state == LeaseState.SLEEPING
                    and r.info.wake_copy not in (None, new_root)
                    and default_name(r.info.engine_class, r.info.name) == name]
        if not sleepers:
            return
        try:
            old = old_root()
        except (HoldfastError, OSError):
            return  # no readable copy there: none a sleeper could wake from
        stranded = [r.id for r in sleepers if r.info.wake_copy == old]
        if stranded:
            raise Conflict(f"copy {name} is what sleeping lease(s) {', '.join(stranded)} wake from, and these bytes "
                           "are others: not replaced (wake them first, or write this copy under another name)")

    async def keep_for_wake(self, rec: LeaseRecord) -> str:
        """Make sure a copy restores this lease's bytes (the host tier if it has room, else the artifact): its root
        hash, which the sleeping lease keeps (`wake_copy`)."""
        name, _, man = await asyncio.to_thread(self._copy_of, rec)
        if man is not None:
            return man.root
        try:
            self.tier.room_for(name, rec.info.size)
            host = True
        except HoldfastError:
            host = False
        return (await self.snapshot(rec.id, name, host_tier=host, artifact=not host)).root_hash

    async def fill_for_wake(self, rec: LeaseRecord, chunks: list[Any]) -> str:
        """Fill a waking weights lease's new chunks from its copy (hash checked from disk); its source."""
        name, where, _ = await asyncio.to_thread(self._copy_of, rec)
        if where is None:
            raise NotFound(f"no copy of lease {rec.id}'s weights ({name}) to wake it from")
        await self._prune_pinned()
        source, man, files = await asyncio.to_thread(self._source, name, [where])
        window = None
        try:
            window = await asyncio.to_thread(self._window, rec.info.gpu, chunks, to_device=True,
                                             block_bytes=man.block_bytes)
            fill = await asyncio.to_thread(self._fill, window, source, man, files)
            log.info("lease %s woken from its %s copy (%s): %d bytes in %.3f s", rec.id, source, fill.path, man.size,
                     fill.seconds)
        finally:
            if window is not None:
                await asyncio.to_thread(window.close)
            elif source == "host":
                OpenFiles(files, direct=False).close()
        return source

    # ------------------------------------------------------------ policy

    def after_commit(self, recs: list[LeaseRecord]) -> None:
        """Start the copies the settings ask for, once per artifact name (called under the book's lock)."""
        for rec in recs:
            if rec.info.tag != Tag.WEIGHTS or rec.info.layout_hash is None:
                continue
            name = default_name(rec.info.engine_class, rec.info.name)
            disk = rec.info.engine_class in self.settings.snapshot_classes and ("artifact", name) not in self.policy_done
            host = (rec.info.engine_class in self.settings.host_tier_classes and self.tier.cap > 0
                    and self.tier.get(name) is None and ("host", name) not in self.policy_done)
            if disk:
                self.policy_done.add(("artifact", name))
                disk = not (artifact_path(self.root, name) / "manifest.json").exists()
            if host:
                self.policy_done.add(("host", name))
            if disk or host:
                self._spawn(self._policy_copy(rec.id, name, disk, host), f"copy:{name}")
            elif rec.info.engine_class in self.settings.peer_classes:  # a copy's write hashes it anyway
                self._spawn(self._policy_digest(rec.id), f"digest:{rec.id}")

    async def _policy_digest(self, lease_id: str) -> None:
        try:
            await self.digest(lease_id)
        except Exception as e:  # noqa: BLE001 - a lease not hashed is not a peer: restores go on as before
            log.warning("hashing lease %s for peer restores failed: %r", lease_id, e)

    async def _policy_copy(self, lease_id: str, name: str, disk: bool, host: bool) -> None:
        try:
            await self.snapshot(lease_id, name, host_tier=host, artifact=disk)
        except Exception as e:  # noqa: BLE001 - a policy copy failing leaves the cold path as it was
            log.warning("copy of lease %s to %s by policy failed: %r", lease_id, name, e)

    def _spawn(self, coro: Coroutine[Any, Any, Any], label: str) -> None:
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro, name=label)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.pinned is not None:
            await asyncio.to_thread(self.pinned.close)
        self.tier.close()

