"""`BlockCopier`: KV blocks between the paged cache and the backup's block-major host copy (backup.py).

CUDA: the copy runs on a stream of its own, after an event recorded on the step's stream (`mark`), so the step's
kernels never wait for it: per chunk of `STAGE_BLOCKS` blocks, one gather kernel into a small device staging buffer
(block-major, contiguous), then one device-to-host copy per run of consecutive block ids straight into the backup,
whose pages are registered with CUDA (cudaHostRegister: page-locked in place, a DMA target; a lease's memfd mapping
is not torch's pinned memory) so the copy is asynchronous DMA, not a staged pageable copy. The staging buffer is
reused in stream order. CPU: a plain copy per run, on the calling thread (the writer's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.batched.kv_backup import block_runs

STAGE_BLOCKS = 32


class CudaRegisterError(RuntimeError):
    """cudaHostRegister refused the backup's pages."""


def register_host(t: torch.Tensor) -> bool:
    """Page-lock `t`'s memory in place for DMA (cudaHostRegister); False when it is pinned already."""
    if t.is_pinned():
        return False
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise CudaRegisterError(f"cudaHostRegister of the KV backup ({t.numel() * t.element_size()} bytes) failed: {err}")
    return True


class BlockCopier:
    def __init__(self, kv: torch.Tensor, backup_kv: torch.Tensor) -> None:
        # [layers, 2, blocks, ...] viewed block-major, as the backup is laid out (no copy)
        self.src = kv.permute(2, 0, 1, 3, 4, 5)
        self.dst = backup_kv
        if tuple(self.src.shape) != tuple(backup_kv.shape) or backup_kv.dtype != kv.dtype:
            raise ValueError(f"the backup's cache {tuple(backup_kv.shape)} {backup_kv.dtype} is not the cache's "
                             f"{tuple(self.src.shape)} {kv.dtype}")
        self.block_bytes = self.src[0].numel() * kv.element_size()
        self.cuda = kv.device.type == "cuda"
        self.registered = False
        if self.cuda:
            self.device = kv.device
            self.main = torch.cuda.current_stream(kv.device)  # the step's (start-up runs on the main thread)
            self.stream = torch.cuda.Stream(kv.device)
            self.event = torch.cuda.Event()  # one round at a time (backup.py): reused
            self.stage = torch.empty((min(STAGE_BLOCKS, self.src.shape[0]), *self.src.shape[1:]), dtype=kv.dtype,
                                     device=kv.device)
            self.registered = register_host(backup_kv)
            # a round's block ids, uploaded once (no allocation during a round: a graph capture on another thread
            # forbids it); reused only after the round's synchronize
            n = self.src.shape[0]
            self.idx_host = torch.empty(n, dtype=torch.long).pin_memory()
            self.idx_dev = torch.empty(n, dtype=torch.long, device=kv.device)

    def close(self) -> None:
        """Unregister the backup's pages (page-locked by this copier): a registration outliving the mapping would
        make a later mapping at the same address look pinned already while DMA still targets the old pages."""
        if self.registered:
            self.stream.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.dst.data_ptr())
            self.registered = False

    def mark(self) -> torch.cuda.Event | None:
        """An event after every write the step's stream has queued so far (None on the CPU: writes are done)."""
        if not self.cuda:
            return None
        self.event.record(self.main)
        return self.event

    def copy(self, blocks: Sequence[int], after: torch.cuda.Event | None) -> None:
        """`blocks` of the cache into the backup; returns once they are there."""
        if not blocks:
            return
        if not self.cuda:
            for b0, n in block_runs(blocks):
                self.dst[b0:b0 + n].copy_(self.src[b0:b0 + n])
            return
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            cap = self.stage.shape[0]
            self.idx_host[:len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            self.idx_dev[:len(blocks)].copy_(self.idx_host[:len(blocks)], non_blocking=True)
            for at in range(0, len(blocks), cap):
                chunk = list(blocks[at:at + cap])
                torch.index_select(self.src, 0, self.idx_dev[at:at + len(chunk)], out=self.stage[:len(chunk)])
                i = 0
                for b0, n in block_runs(chunk):  # chunk is ascending: its runs are in its order
                    self.dst[b0:b0 + n].copy_(self.stage[i:i + n], non_blocking=True)
                    i += n
        self.stream.synchronize()

    def restore(self, blocks: Sequence[int]) -> None:
        """`blocks` of the backup into the cache (a successor's start-up: synchronous)."""
        for b0, n in block_runs(blocks):
            self.src[b0:b0 + n].copy_(self.dst[b0:b0 + n])
        if self.cuda:
            torch.cuda.synchronize(self.device)
