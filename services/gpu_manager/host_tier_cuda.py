"""The host tier's copies page-locked in place, so a restore on the cuda backend DMAs each block straight from the
tier's own pages to the device (issue 21, docs/restore.md): the copy's memfds are mapped in the manager and
registered with cuMemHostRegister, and each 64 MiB block goes host-to-device with cuMemcpyHtoDAsync, round robin
on the window's streams. No CPU copy through a pinned bounce buffer (the path that reached 47% of the pinned
host-to-device speed of light on an H200), and no thread per block.

A copy is registered when it is written (restore.py `snapshot`) or adopted after a manager restart (`pin`, the
seconds it took in the write's figures), and kept while that copy is the tier's, so every restore (a cold start, a
level-2 wake) is DMA only; registering took 1.5-3.1 s for 16 GiB on the H200 host (0.1-0.2 s a GiB), which a cold start
must not pay. A copy whose registration failed then is registered by its first restore (`acquire`, timed apart:
its `register_s`), or read through bounce buffers where that fails too. Registering pins the copy's pages, which
the tier's memory is meant to be anyway (resident); it pins no other memory: the registered bytes are the tier's
own, capped by `host_tier_bytes` (`bytes`).

Invariants:
1. A registration is unregistered and unmapped only once no restore uses it (`acquire`/`release` count users).
2. A registration serves only the copy it was made from (its key: name, root hash, size, creation time); a
   replaced or dropped copy's registration is retired at the next `acquire` or `prune` (the write of a copy
   prunes before it registers), so the registered bytes pass the tier's only while a restore still reads a
   replaced copy.
3. A failed registration leaves nothing mapped or registered; the caller falls back to the bounce path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libs.client import cuda_driver as cd
from libs.common.errors import HoldfastError
from services.gpu_manager.artifact import Block, Manifest

log = logging.getLogger("holdfast.gpu_manager.host_tier_cuda")
cu = cd.cu
# Portable: usable from every context (the manager retains one primary context per GPU). Not READ_ONLY: that
# needs a device attribute; the mapping is read-write, and only host-to-device copies ever use it.
REGISTER_FLAGS = int(getattr(cu, "CU_MEMHOSTREGISTER_PORTABLE", 1))


def copy_key(man: Manifest) -> tuple[str, str, int, float]:
    return (man.name, man.root, man.size, man.created_at)


class RegisteredCopy:
    """One tier copy's files mapped back to back in this process, each file's range registered on its own (a block
    never crosses a file: artifact.plan_blocks)."""

    def __init__(self, fds: Sequence[int], sizes: Sequence[int], ordinal: int) -> None:
        from libs.client.mapping import HostMapping

        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = list(sizes)
        self.registered: list[int] = []
        t0 = time.perf_counter()
        self.mapping = HostMapping(list(fds), list(sizes))  # the mapping keeps the pages; the fds may close
        self.ctx = None
        try:
            self.ctx = cd.primary_context(ordinal)
            for start, size in zip(self.starts, self.sizes, strict=True):
                cd.check(cu.cuMemHostRegister(self.mapping.base + start, size, REGISTER_FLAGS))
                self.registered.append(self.mapping.base + start)
        except BaseException:
            self.close()  # invariant 3
            raise
        self.register_s = time.perf_counter() - t0

    def ptr(self, block: Block) -> int:
        return self.mapping.base + self.starts[block.file] + block.file_offset

    def close(self) -> None:
        """From any thread (a prune runs on one of its own): the context is made current first."""
        if self.registered:
            cd.check(cu.cuCtxSetCurrent(self.ctx))
        for ptr in self.registered:
            try:
                cd.check(cu.cuMemHostUnregister(ptr))
            except cd.CudaError as e:  # logged, and the range unmapped anyway: the pages go with the mapping
                log.error("cuMemHostUnregister of a tier range failed: %s", e)
        self.registered = []
        self.mapping.unmap()


@dataclass
class _Entry:
    key: tuple[str, str, int, float]
    copy: RegisteredCopy
    users: int = 0
    retired: bool = False


class PinnedTier:
    """The registrations of the tier's copies, by copy name (thread-safe: restores run on worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._limbo: list[_Entry] = []  # retired while in use: closed by their last release (invariant 1)

    def acquire(self, man: Manifest, fds: Sequence[int], ordinal: int) -> tuple[RegisteredCopy, float]:
        """The copy's registration (made now if needed) and the seconds registering took now (0: it was there).
        Raises CudaError (or OSError from the mapping) when it cannot be made: the caller takes the bounce path."""
        key = copy_key(man)
        with self._lock:
            entry = self._entries.get(man.name)
            if entry is not None and entry.key != key:
                self._retire(man.name, entry)  # invariant 2
                entry = None
            took = 0.0
            if entry is None:
                entry = _Entry(key, RegisteredCopy(fds, [f.bytes for f in man.files], ordinal))
                self._entries[man.name] = entry
                took = entry.copy.register_s
                log.info("host tier copy %s page-locked in place: %d bytes in %.3f s", man.name, man.size, took)
            entry.users += 1
            return entry.copy, took

    def release(self, copy: RegisteredCopy) -> None:
        with self._lock:
            for entry in [*self._entries.values(), *self._limbo]:
                if entry.copy is copy:
                    entry.users -= 1
                    if entry.retired and entry.users == 0:
                        self._limbo.remove(entry)
                        entry.copy.close()
                    return

    def _retire(self, name: str, entry: _Entry) -> None:
        del self._entries[name]
        entry.retired = True
        if entry.users == 0:
            entry.copy.close()
        else:
            self._limbo.append(entry)

    def prune(self, live: dict[str, Manifest]) -> None:
        """Retire the registrations of copies the tier no longer holds as they were (invariant 2)."""
        with self._lock:
            for name, entry in list(self._entries.items()):
                man = live.get(name)
                if man is None or copy_key(man) != entry.key:
                    self._retire(name, entry)

    def close(self) -> None:
        self.prune({})

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def bytes(self) -> int:
        """Host memory page-locked now: every registration's, the retired ones still read by a restore included."""
        with self._lock:
            return sum(sum(e.copy.sizes) for e in [*self._entries.values(), *self._limbo])

    def pin(self, man: Manifest, fds: Sequence[int], ordinal: int) -> float | None:
        """Register a copy ahead of its restores (at its write or adoption; blocking): the seconds it took (0: it was
        registered), or None where it could not be (logged; its restores try again, else take the bounce path).
        `fds` are the caller's to close; the registration's mapping keeps the pages."""
        try:
            copy, took = self.acquire(man, fds, ordinal)
        except (cd.CudaError, OSError, HoldfastError) as e:
            log.warning("host tier copy %s could not be page-locked at its write (%s): its restores will try again, "
                        "else go through bounce buffers", man.name, e)
            return None
        self.release(copy)
        return took


def dma_blocks(window: Any, copy: RegisteredCopy, blocks: Sequence[Block]) -> float:
    """Every block host-to-device from the registered copy into the window's device range, round robin on its
    streams; returns once all completed (the seconds it took)."""
    t0 = time.perf_counter()
    window.current()
    streams = window.streams
    for i, b in enumerate(blocks):
        cd.check(cu.cuMemcpyHtoDAsync(window.base + b.offset, copy.ptr(b), b.nbytes, streams[i % len(streams)]))
    window.finish()
    return time.perf_counter() - t0
