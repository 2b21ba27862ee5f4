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

Which copies are registered, who uses each and when one goes is tier_pins.py (pure, its invariants); this module
makes and closes a registration. Invariant: a failed registration leaves nothing mapped or registered (the
caller falls back to the bounce path).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from libs.client import cuda_driver as cd
from services.gpu_manager.artifact import Block
from services.gpu_manager.tier_pins import TierPins

log = logging.getLogger("holdfast.gpu_manager.host_tier_cuda")
cu = cd.cu
# Portable: usable from every context (the manager retains one primary context per GPU). Not READ_ONLY: that
# needs a device attribute; the mapping is read-write, and only host-to-device copies ever use it.
REGISTER_FLAGS = int(getattr(cu, "CU_MEMHOSTREGISTER_PORTABLE", 1))


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
            self.close()  # nothing left registered or mapped
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


class PinnedTier(TierPins):
    """The tier's copies registered in place (the bookkeeping: tier_pins.py)."""

    def __init__(self) -> None:
        super().__init__(RegisteredCopy)


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
