"""The host tier: copies of models' weights kept in the node's host memory (memfds), held by the fd keeper like
every lease (key `tier/<artifact name>`), so a gpu_manager restart keeps them. A cold start on this node
restores from a copy at memory/PCIe speed instead of reading a file.

A copy is laid out exactly like an artifact (artifact.py): its "files" are memfds of `file_bytes` each, and
its manifest (with the block hashes taken while copying) rides in the keeper entry's metadata, so the same
block reader serves both (blockio.py).

Invariants (tests/gpu_manager/test_tier.py):
1. The tier never holds more than `cap` bytes: a copy that would pass it is refused (OutOfMemory), nothing
   evicted behind the operator's back.
2. A copy is in `entries` exactly while the keeper holds its fds; replacing or dropping one closes the old fds.
3. On cuda the copies are page-locked in place (host_tier_cuda.py): that pins the copies' own pages, no other
   memory, so the registered bytes (`registered_bytes` in health) stay within the cap (but while a restore still
   reads a replaced copy).
4. A replaced or dropped copy's fds are closed off the event loop: the last close of a memfd frees its pages
   in the call (0.17 s a GiB measured: 16 s for a 96 GiB copy, during which the manager would answer nothing),
   and the keeper lets go of its own first, so ours is often the last (tests/gpu_manager/test_tier_loop.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from libs.client.protocol import OutOfMemory
from services.gpu_manager.artifact import Manifest
from services.gpu_manager.keeper_client import KeeperClient

log = logging.getLogger("holdfast.gpu_manager.tier")

TIER_PREFIX = "tier/"


@dataclass
class TierCopy:
    manifest: Manifest
    fds: list[int]

    @property
    def bytes(self) -> int:
        return self.manifest.size


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class HostTier:
    def __init__(self, cap_bytes: int, keeper: KeeperClient) -> None:
        self.cap = cap_bytes
        self.keeper = keeper
        self.entries: dict[str, TierCopy] = {}
        self.pinned_bytes: Callable[[], int] = lambda: 0  # cuda: host_tier_cuda.PinnedTier.bytes

    @property
    def used(self) -> int:
        return sum(c.bytes for c in self.entries.values())

    def adopt(self, kept: dict[str, tuple[dict[str, Any], list[int]]]) -> None:
        """After a restart: the keeper's `tier/` entries become copies again (an unreadable one is dropped)."""
        for key, (meta, fds) in kept.items():
            name = key.removeprefix(TIER_PREFIX)
            try:
                man = Manifest.model_validate(meta["manifest"])
                if len(fds) != len(man.files):
                    raise ValueError(f"{len(fds)} fds for {len(man.files)} files")
            except (KeyError, ValueError) as e:
                log.error("host tier copy %s is unreadable (%s): dropping it", name, e)
                _close(fds)
                continue
            self.entries[name] = TierCopy(man, fds)
        if self.entries:
            log.info("host tier: %d copies, %d bytes, kept through the restart", len(self.entries), self.used)

    def room_for(self, name: str, size: int) -> None:
        """Invariant 1: refuse a copy the cap has no room for (a copy replacing `name` frees its bytes)."""
        old = self.entries.get(name)
        used = self.used - (old.bytes if old else 0)
        if used + size > self.cap:
            raise OutOfMemory(f"host tier: {size} bytes asked for {name}, {self.cap - used} of {self.cap} free")

    def make_files(self, name: str, man_sizes: list[int]) -> list[int]:
        fds: list[int] = []
        try:
            for i, size in enumerate(man_sizes):
                fd = os.memfd_create(f"hf-tier-{name}-{i}", os.MFD_CLOEXEC)
                fds.append(fd)
                os.ftruncate(fd, size)
        except BaseException:
            _close(fds)
            raise
        return fds

    async def put(self, name: str, man: Manifest, fds: list[int]) -> None:
        self.room_for(name, man.size)
        await self.keeper.put(TIER_PREFIX + name, fds, {"manifest": man.model_dump(mode="json")})
        old = self.entries.pop(name, None)
        self.entries[name] = TierCopy(man, fds)
        if old is not None:
            await asyncio.to_thread(_close, old.fds)  # invariant 4
        log.info("host tier: %s held (%d bytes; %d of %d used)", name, man.size, self.used, self.cap)

    async def drop(self, name: str) -> bool:
        old = self.entries.pop(name, None)
        if old is None:
            return False
        await asyncio.to_thread(_close, old.fds)  # invariant 4
        await self.keeper.drop(TIER_PREFIX + name)
        return True

    def get(self, name: str) -> TierCopy | None:
        return self.entries.get(name)

    def health(self) -> dict[str, Any]:
        return {"copies": sorted(self.entries), "bytes": self.used, "cap": self.cap,
                "registered_bytes": self.pinned_bytes()}

    def close(self) -> None:
        """Our fds only: the keeper still holds every copy."""
        for c in self.entries.values():
            _close(c.fds)
        self.entries.clear()
