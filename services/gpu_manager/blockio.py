"""Parallel block I/O between a lease's memory and a set of files (artifact files on disk, or the host tier's
memfds): many blocks in flight on a pool of threads (libs/client/direct_io.py: `os.preadv`/`os.pwritev`, which
release the GIL, and so does hashing), with O_DIRECT where the filesystem takes it.

Where the bytes go is the caller's `Window`: the host backend hands out views of the lease's own mapped pages
(the read lands in the memfd, no other copy); the cuda backend hands out pinned staging buffers and copies
each block to the device on the worker's stream once read (restore_cuda.py), so disk and PCIe overlap.

Invariants:
1. Every block is read (or written) whole, or the run fails: a short read is a truncated file (`ArtifactInvalid`).
2. With `verify`, no block is handed to the window's `done` before its hash matched the manifest's.
3. The first failure stops every worker before its next block and is the one raised.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from libs.client.direct_io import OpenFiles, read_exact, run_blocks, write_exact
from libs.client.protocol import ArtifactInvalid
from services.gpu_manager.artifact import Block, block_digest


class Window(Protocol):
    """Memory the workers read into (restore) or write from (snapshot), one block at a time per worker."""

    def buffer(self, worker: int, block: Block) -> memoryview: ...
    def done(self, worker: int, block: Block, buf: memoryview) -> None: ...
    def finish(self) -> None: ...


def read_blocks(files: OpenFiles, blocks: Sequence[Block], window: Window, *, workers: int,
                digests: Sequence[str] | None, what: str) -> float:
    """Fill the window from the files (restore); returns the seconds it took. `digests`: verify each block."""
    t0 = time.perf_counter()

    def step(worker: int, block: Block) -> None:
        buf = window.buffer(worker, block)
        read_exact(files.fds[block.file], buf, block.file_offset, what)
        if digests is not None and block_digest(buf) != digests[block.index]:
            raise ArtifactInvalid(f"{what}: block {block.index} (bytes {block.offset}..{block.offset + block.nbytes}) "
                                  "does not match its hash (corrupt)")
        window.done(worker, block, buf)

    run_blocks(blocks, workers, step)
    window.finish()
    return time.perf_counter() - t0


def write_blocks(files: OpenFiles, blocks: Sequence[Block], window: Window, *, workers: int) -> list[str]:
    """Write the window to the files (snapshot) and return each block's digest, in block order."""
    digests = [""] * len(blocks)

    def step(worker: int, block: Block) -> None:
        buf = window.buffer(worker, block)
        digests[block.index] = block_digest(buf)
        write_exact(files.fds[block.file], buf, block.file_offset)
        window.done(worker, block, buf)

    run_blocks(blocks, workers, step)
    window.finish()
    return digests


class HostWindow:
    """A lease's host memory mapped contiguously in this process: blocks are views of its own pages, so a read
    lands in the memfd and a write reads from it, with no copy in between."""

    def __init__(self, fds: list[int], sizes: list[int], *, read_only: bool) -> None:
        from libs.client.mapping import HostMapping

        self.mapping = HostMapping(fds, sizes, read_only=read_only)

    def buffer(self, worker: int, block: Block) -> memoryview:
        return memoryview(self.mapping.buffer(block.offset, block.nbytes)).cast("B")

    def done(self, worker: int, block: Block, buf: memoryview) -> None:
        buf.release()

    def finish(self) -> None:
        pass

    def close(self) -> None:
        self.mapping.unmap()
