"""The cuda side of a peer copy (peer.py): the peer lease's VMM chunks mapped into the manager's address space, and
every block copied device to device into the new lease on the destination window's streams.

Across two GPUs the copy is cuMemcpyPeerAsync (NVLink/P2P DMA where the pair can reach each other: the peer's
range is then made accessible to the destination GPU too; otherwise the driver stages it through the host); on one
GPU it is cuMemcpyDtoDAsync. Not run on hardware yet: it needs two GPUs (tests/gpu_manager/test_peer_cuda.py is
skipped below two).

Invariants:
1. The mapping holds the peer's physical memory while it lives (a reclaim releases the manager's handles; the memory
   goes with this mapping's unmap), so the copy never reads freed memory (peer.py, invariant 1).
2. `copy_cuda` returns only when every block's copy completed (every stream of the window synchronised): the lease
   is handed out after that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from libs.client import cuda_driver as cd
from services.gpu_manager.artifact import Block
from services.gpu_manager.backends import Chunk

cu = cd.cu


def can_reach(src: int, dst: int) -> bool:
    """Whether GPU `dst` can read GPU `src`'s memory directly (NVLink or PCIe P2P)."""
    if src == dst:
        return True
    ok = cd.check(cu.cuDeviceCanAccessPeer(cd.check(cu.cuDeviceGet(dst)), cd.check(cu.cuDeviceGet(src))))
    return bool(ok)


class PeerMapping:
    """The peer lease's chunks mapped back to back in this process (blocking: build and close off the loop)."""

    def __init__(self, ordinal: int, chunks: list[Chunk], dest: int) -> None:
        self.ordinal = ordinal
        self.ctx = cd.primary_context(ordinal)
        self.size = sum(c.size for c in chunks)
        self.base = int(cd.check(cu.cuMemAddressReserve(self.size, 0, 0, 0)))
        self.mapped = 0
        try:
            for c in chunks:
                cd.check(cu.cuMemMap(self.base + self.mapped, c.size, 0, c.handle, 0))
                self.mapped += c.size
            access = [cd.access_desc(ordinal)]
            if dest != ordinal and can_reach(ordinal, dest):
                access.append(cd.access_desc(dest))
            cd.check(cu.cuMemSetAccess(self.base, self.size, access, len(access)))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        cd.check(cu.cuCtxSetCurrent(self.ctx))
        if self.mapped:
            cd.check(cu.cuMemUnmap(self.base, self.mapped))
            self.mapped = 0
        if self.base:
            cd.check(cu.cuMemAddressFree(self.base, self.size))
            self.base = 0


def copy_cuda(window: Any, src: PeerMapping, blocks: Sequence[Block]) -> float:
    """Every block from the peer into the window's device range, round robin on its streams (on the destination
    GPU's context); returns once all completed (invariant 2), the seconds it took."""
    t0 = time.perf_counter()
    window.current()
    streams = window.streams
    for i, b in enumerate(blocks):
        stream = streams[i % len(streams)]
        if src.ordinal == window.ordinal:
            cd.check(cu.cuMemcpyDtoDAsync(window.base + b.offset, src.base + b.offset, b.nbytes, stream))
        else:
            cd.check(cu.cuMemcpyPeerAsync(window.base + b.offset, window.ctx, src.base + b.offset, src.ctx, b.nbytes,
                                          stream))
    window.finish()
    return time.perf_counter() - t0
