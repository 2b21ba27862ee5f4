"""The cuda side of block I/O: a lease's VMM chunks mapped into the manager's address space, and per worker
two pinned staging buffers and one stream, so that a worker reads block n+1 from disk while block n crosses
PCIe (restore), or copies block n+1 to the host while block n is written (snapshot).

No pageable memory on the way: disk -> pinned buffer (O_DIRECT DMA where allowed) -> device (cuMemcpyHtoDAsync).
Every thread that touches the device makes the manager's primary context current first.

The host tier's copies skip the staging buffers where they can: registered in place, their blocks go
host-to-device on this window's streams (host_tier_cuda.py); so a worker's pinned buffers are allocated only when
it first asks for one.

Invariants:
1. A staging buffer is reused only after the event recorded behind its last copy completed.
2. `finish` returns only when every copy of every stream is complete; `close` unmaps the range and frees the
   pinned memory but never releases the chunks' handles (they are the lease's).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from libs.client import cuda_driver as cd
from services.gpu_manager.artifact import Block
from services.gpu_manager.backends import Chunk

cu = cd.cu
NON_BLOCKING = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
NO_TIMING = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)


class CudaWindow:
    def __init__(self, ordinal: int, chunks: list[Chunk], *, workers: int, block_bytes: int, to_device: bool) -> None:
        self.ordinal = ordinal
        self.ctx = cd.primary_context(ordinal)
        self.size = sum(c.size for c in chunks)
        self.to_device = to_device  # restore: host -> device; snapshot: device -> host
        self.block_bytes = block_bytes
        self.base = int(cd.check(cu.cuMemAddressReserve(self.size, 0, 0, 0)))
        self.mapped = 0
        self.pinned: list[list[int]] = []
        self.streams: list[Any] = []
        self.events: list[list[Any]] = []
        self.turn: list[int] = []
        self._local = threading.local()
        try:
            for c in chunks:
                cd.check(cu.cuMemMap(self.base + self.mapped, c.size, 0, c.handle, 0))
                self.mapped += c.size
            cd.check(cu.cuMemSetAccess(self.base, self.size, [cd.access_desc(ordinal)], 1))
            for _ in range(workers):
                self.pinned.append([])  # allocated at the worker's first `buffer`
                self.streams.append(cd.check(cu.cuStreamCreate(NON_BLOCKING)))
                self.events.append([cd.check(cu.cuEventCreate(NO_TIMING))
                                    for _ in range(2)])
                self.turn.append(0)
            self.used = [[False, False] for _ in range(workers)]
        except BaseException:
            self.close()
            raise

    def current(self) -> None:
        """Make the manager's primary context current on this thread (once per thread)."""
        if getattr(self._local, "ctx", None) is None:
            cd.check(cu.cuCtxSetCurrent(self.ctx))
            self._local.ctx = self.ctx

    def buffer(self, worker: int, block: Block) -> memoryview:
        """The worker's next staging buffer, free (invariant 1); on snapshot, already holding the block."""
        self.current()
        if not self.pinned[worker]:
            flags = int(getattr(cu, "CU_MEMHOSTALLOC_PORTABLE", 1))
            for _ in range(2):
                self.pinned[worker].append(int(cd.check(cu.cuMemHostAlloc(self.block_bytes, flags))))
        slot = self.turn[worker]
        if self.used[worker][slot]:
            cd.check(cu.cuEventSynchronize(self.events[worker][slot]))
        ptr = self.pinned[worker][slot]
        if not self.to_device:
            cd.check(cu.cuMemcpyDtoHAsync(ptr, self.base + block.offset, block.nbytes, self.streams[worker]))
            cd.check(cu.cuStreamSynchronize(self.streams[worker]))
        return memoryview((ctypes.c_ubyte * block.nbytes).from_address(ptr)).cast("B")

    def done(self, worker: int, block: Block, buf: memoryview) -> None:
        slot = self.turn[worker]
        if self.to_device:
            ptr = self.pinned[worker][slot]
            cd.check(cu.cuMemcpyHtoDAsync(self.base + block.offset, ptr, block.nbytes, self.streams[worker]))
            cd.check(cu.cuEventRecord(self.events[worker][slot], self.streams[worker]))
            self.used[worker][slot] = True
        self.turn[worker] = 1 - slot
        buf.release()

    def finish(self) -> None:
        self.current()
        for s in self.streams:
            cd.check(cu.cuStreamSynchronize(s))

    def close(self) -> None:
        self.current()
        for s in self.streams:
            cd.check(cu.cuStreamSynchronize(s))
            cd.check(cu.cuStreamDestroy(s))
        for pair in self.events:
            for e in pair:
                cd.check(cu.cuEventDestroy(e))
        for pair in self.pinned:
            for ptr in pair:
                cd.check(cu.cuMemFreeHost(ptr))
        self.streams, self.events, self.pinned = [], [], []
        if self.mapped:
            cd.check(cu.cuMemUnmap(self.base, self.mapped))
            self.mapped = 0
        if self.base:
            cd.check(cu.cuMemAddressFree(self.base, self.size))
            self.base = 0


def pinned_h2d_gib_s(ordinal: int, nbytes: int, streams: int = 4, trials: int = 3) -> float:
    """The speed of light of host -> device from pinned memory on this machine (the bench's reference)."""
    ctx = cd.primary_context(ordinal)
    cd.check(cu.cuCtxSetCurrent(ctx))
    per = nbytes // streams
    host = int(cd.check(cu.cuMemHostAlloc(nbytes, 1)))
    dev = int(cd.check(cu.cuMemAlloc(nbytes)))
    ss = [cd.check(cu.cuStreamCreate(NON_BLOCKING)) for _ in range(streams)]
    import time

    best = []
    try:
        for _ in range(trials):
            t0 = time.perf_counter()
            for i, s in enumerate(ss):
                cd.check(cu.cuMemcpyHtoDAsync(dev + i * per, host + i * per, per, s))
            for s in ss:
                cd.check(cu.cuStreamSynchronize(s))
            best.append(per * streams / (time.perf_counter() - t0) / 2**30)
    finally:
        for s in ss:
            cd.check(cu.cuStreamDestroy(s))
        cd.check(cu.cuMemFree(dev))
        cd.check(cu.cuMemFreeHost(host))
    return sorted(best)[len(best) // 2]
