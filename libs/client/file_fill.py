"""A mapped lease filled from byte ranges of one file (an engine's cold load of its weights file): aligned blocks
of the file read in parallel (O_DIRECT where the filesystem takes it, direct_io.py), each block's pieces copied to
their places in the lease as soon as it is read. On cuda a block lands in a pinned buffer of its worker and goes to
the device with asynchronous copies on the worker's stream, so the disk is never idle while PCIe works; on the host
backend the pieces are copied into the lease's shared pages.

Why not read each tensor where it goes: the ranges the engine wants (its own layout, parts fused back to back)
start at any byte of the file, and O_DIRECT needs aligned offsets, lengths and buffers; and one read in flight at
a time (the path before this one: one 64 MiB bounce buffer, pread then copy) left the disk at ~0.77 of what it
reads with many in flight (H200 machine, 16 GiB: 1.35 against 1.75 GiB/s).

Invariants (tests/client/test_file_fill.py):
1. `plan_reads`: every byte of every range is in exactly one piece; each piece lies inside its block's `need`;
   every block's file offset and length are multiples of ALIGN; blocks are in file order and do not overlap.
2. A file that ends before a block's `need` is refused (`MalformedMessage`), whatever the block's padding.
3. A pinned buffer is read into again only after the copies out of it completed (its worker's event).
4. Reads are O_DIRECT (where the filesystem takes it) unless CACHED_SHARE of the span read is in the page cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.client.direct_io import ALIGN, open_files, read_upto, resident_share, run_blocks
from libs.common.errors import MalformedMessage

BLOCK_BYTES = 64 * 1024 * 1024
# A file at least this much in the page cache is read buffered: its cached pages come at memory speed (a node that
# starts an engine again soon after, or whose file was just written), which O_DIRECT would read from disk again.
CACHED_SHARE = 0.5


@dataclass(frozen=True)
class Piece:
    buf_offset: int  # where in the block's buffer
    lease_offset: int  # where in the lease
    nbytes: int


@dataclass(frozen=True)
class ReadBlock:
    file_offset: int  # aligned
    nbytes: int  # aligned: what is asked of the file (it may end before, within the padding)
    need: int  # bytes of the block that must be there (the end of its last piece)
    pieces: tuple[Piece, ...]


def plan_reads(ranges: Sequence[tuple[int, int, int]], block_bytes: int = BLOCK_BYTES,
               align: int = ALIGN) -> list[ReadBlock]:
    """Blocks that cover `ranges` [(file offset, lease offset, bytes)]. Pure. Ranges whose aligned spans touch
    are read as one extent, split into blocks of at most `block_bytes`; a gap between extents is never read."""
    if block_bytes <= 0 or block_bytes % align:
        raise ValueError(f"block of {block_bytes} bytes: not a positive multiple of {align}")
    todo = sorted((r for r in ranges if r[2] > 0), key=lambda r: r[0])
    extents: list[list[int]] = []  # [aligned start, aligned end]
    for f, _, n in todo:
        lo, hi = f - f % align, _up(f + n, align)
        if extents and lo <= extents[-1][1]:
            extents[-1][1] = max(extents[-1][1], hi)
        else:
            extents.append([lo, hi])
    blocks: list[ReadBlock] = []
    first = 0  # the first range that may reach into the current block (ranges sorted by start)
    for start, stop in extents:
        for off in range(start, stop, block_bytes):
            n = min(block_bytes, stop - off)
            while first < len(todo) and todo[first][0] + todo[first][2] <= off:
                first += 1
            pieces, need = [], 0
            for f, lease, size in todo[first:]:
                if f >= off + n:
                    break
                lo, hi = max(f, off), min(f + size, off + n)
                if lo < hi:
                    pieces.append(Piece(lo - off, lease + lo - f, hi - lo))
                    need = max(need, hi - off)
            blocks.append(ReadBlock(off, n, need, tuple(pieces)))
    return blocks


def _up(x: int, align: int) -> int:
    return -(-x // align) * align


def fill_from_file(mapping: Any, path: str | Path, ranges: Sequence[tuple[int, int, int]], *, workers: int = 8,
                   block_bytes: int = BLOCK_BYTES) -> bool:
    """Copy each (file offset, lease offset, bytes) of `path` into the mapped lease (`mapping`: libs.client's host
    or cuda mapping); returns whether the reads were O_DIRECT (invariant 4). Returns when every byte is in place."""
    blocks = plan_reads(ranges, block_bytes)
    if not blocks:
        return False
    lo, hi = blocks[0].file_offset, blocks[-1].file_offset + blocks[-1].nbytes
    direct = resident_share(Path(path), lo, hi - lo) < CACHED_SHARE  # invariant 4
    files = open_files([Path(path)], write=False, direct=direct)
    size = max(b.nbytes for b in blocks)
    sink: _CudaSink | _HostSink = _CudaSink(mapping, size) if mapping.kind == "cuda" else _HostSink(mapping, size)
    try:
        def step(worker: int, block: ReadBlock) -> None:
            with sink.buffer(worker) as buf, buf[:block.nbytes] as view:
                got = read_upto(files.fds[0], view, block.file_offset)
            if got < block.need:
                raise MalformedMessage(f"{path}: the file ends at byte {block.file_offset + got}, before the "
                                       f"{block.file_offset + block.need} its header says (truncated)")
            sink.send(worker, block.pieces)

        run_blocks(blocks, min(workers, len(blocks)), step)
        sink.finish()
    finally:
        sink.close()
        files.close()
    return files.direct


class _HostSink:
    """Page-aligned anonymous buffers (O_DIRECT takes them); pieces copied into the lease's pages (memmove
    releases the GIL)."""

    def __init__(self, mapping: Any, size: int) -> None:
        self.base, self.size = mapping.base, size
        self.bufs: dict[int, mmap.mmap] = {}
        self.addrs: dict[int, int] = {}
        self.lock = threading.Lock()

    def buffer(self, worker: int) -> memoryview:
        with self.lock:
            if worker not in self.bufs:
                buf = self.bufs[worker] = mmap.mmap(-1, self.size)
                view = ctypes.c_char.from_buffer(buf)
                self.addrs[worker] = ctypes.addressof(view)
                del view  # no export left behind: the mmap can be closed
        return memoryview(self.bufs[worker])

    def send(self, worker: int, pieces: Sequence[Piece]) -> None:
        src = self.addrs[worker]
        for p in pieces:
            ctypes.memmove(self.base + p.lease_offset, src + p.buf_offset, p.nbytes)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        for b in self.bufs.values():
            with contextlib.suppress(BufferError):  # a failed read's traceback may still view it: the GC unmaps it
                b.close()
        self.bufs, self.addrs = {}, {}


class _CudaSink:
    """Per worker one pinned buffer (page-aligned, from the driver), one stream and one event (invariant 3); the
    lease's own context made current on each worker thread."""

    def __init__(self, mapping: Any, size: int) -> None:
        from libs.client import cuda_driver as cd

        self.cd, self.cu = cd, cd.cu
        self.base, self.size = mapping.base, size
        self.ctx = cd.primary_context(mapping.ordinal)
        self.pinned: dict[int, int] = {}
        self.streams: dict[int, Any] = {}
        self.events: dict[int, Any] = {}
        self.lock = threading.Lock()
        self._local = threading.local()

    def buffer(self, worker: int) -> memoryview:
        cd, cu = self.cd, self.cu
        if getattr(self._local, "ctx", None) is None:
            cd.check(cu.cuCtxSetCurrent(self.ctx))
            self._local.ctx = self.ctx
        if worker not in self.pinned:
            with self.lock:
                self.pinned[worker] = int(cd.check(cu.cuMemHostAlloc(self.size, 0)))
                self.streams[worker] = cd.check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))
                self.events[worker] = cd.check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)))
        else:
            cd.check(cu.cuEventSynchronize(self.events[worker]))
        return memoryview((ctypes.c_ubyte * self.size).from_address(self.pinned[worker])).cast("B")

    def send(self, worker: int, pieces: Sequence[Piece]) -> None:
        cd, cu = self.cd, self.cu
        src, stream = self.pinned[worker], self.streams[worker]
        for p in pieces:
            cd.check(cu.cuMemcpyHtoDAsync(self.base + p.lease_offset, src + p.buf_offset, p.nbytes, stream))
        cd.check(cu.cuEventRecord(self.events[worker], stream))

    def finish(self) -> None:
        for stream in self.streams.values():
            self.cd.check(self.cu.cuStreamSynchronize(stream))

    def close(self) -> None:
        """Frees what the workers made, on this thread with the lease's context current; the thread's own
        context (the engine's) is current again after."""
        cd, cu = self.cd, self.cu
        before = cd.check(cu.cuCtxGetCurrent())
        cd.check(cu.cuCtxSetCurrent(self.ctx))
        try:
            for w, stream in self.streams.items():
                cd.check(cu.cuStreamSynchronize(stream))
                cd.check(cu.cuStreamDestroy(stream))
                cd.check(cu.cuEventDestroy(self.events[w]))
                cd.check(cu.cuMemFreeHost(self.pinned[w]))
        finally:
            self.pinned, self.streams, self.events = {}, {}, {}
            cd.check(cu.cuCtxSetCurrent(before))
