"""Parallel block I/O between a lease's memory and a set of files (artifact files on disk, or the host tier's
memfds): many blocks in flight on a pool of threads, each a loop of `os.preadv`/`os.pwritev` (they release the
GIL, and so does hashing), with O_DIRECT where the filesystem takes it.

Where the bytes go is the caller's `Window`: the host backend hands out views of the lease's own mapped pages
(the read lands in the memfd, no other copy); the cuda backend hands out pinned staging buffers and copies
each block to the device on the worker's stream once read (restore_cuda.py), so disk and PCIe overlap.

Invariants:
1. Every block is read (or written) whole, or the run fails: a short read is a truncated file (`ArtifactInvalid`).
2. With `verify`, no block is handed to the window's `done` before its hash matched the manifest's.
3. The first failure stops every worker before its next block and is the one raised.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from libs.client.protocol import ArtifactInvalid
from services.gpu_manager.artifact import Block, block_digest

O_DIRECT = getattr(os, "O_DIRECT", 0)


class Window(Protocol):
    """Memory the workers read into (restore) or write from (snapshot), one block at a time per worker."""

    def buffer(self, worker: int, block: Block) -> memoryview: ...
    def done(self, worker: int, block: Block, buf: memoryview) -> None: ...
    def finish(self) -> None: ...


@dataclass
class OpenFiles:
    fds: list[int]
    direct: bool  # every fd is O_DIRECT (False: at least one filesystem refused it, or it was not asked)
    owned: bool = True  # close them when done (a tier's memfds belong to the tier)
    fallbacks: list[str] = field(default_factory=list)

    def close(self) -> None:
        if self.owned:
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


def open_files(paths: Sequence[Path], *, write: bool, direct: bool, sizes: Sequence[int] | None = None) -> OpenFiles:
    """Open (create and size, to write) each file, O_DIRECT if asked and the filesystem allows (tmpfs and some
    network filesystems refuse it with EINVAL: then buffered, and `direct` says so)."""
    base = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
    out = OpenFiles([], direct=direct and bool(O_DIRECT))
    try:
        for i, path in enumerate(paths):
            try:
                fd = os.open(path, base | (O_DIRECT if out.direct else 0) | os.O_CLOEXEC, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL or not out.direct:
                    raise
                out.fallbacks.append(f"{path}: O_DIRECT refused ({e.strerror}), buffered")
                out.direct = False
                fd = os.open(path, base | os.O_CLOEXEC, 0o600)
            out.fds.append(fd)
            if write and sizes is not None:
                os.ftruncate(fd, sizes[i])
    except BaseException:
        out.close()
        raise
    return out


def _drop_direct(fd: int) -> bool:
    """Turn O_DIRECT off on an fd whose filesystem took the flag at open but refuses the I/O (EINVAL)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & O_DIRECT:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
    return True


def read_exact(fd: int, buf: memoryview, offset: int, what: str) -> None:
    done, n = 0, len(buf)
    while done < n:
        try:
            got = os.preadv(fd, [buf[done:]], offset + done)
        except OSError as e:
            if e.errno == errno.EINVAL and _drop_direct(fd):
                continue
            raise
        if got <= 0:
            raise ArtifactInvalid(f"{what}: ends {n - done} bytes early at {offset + done} (truncated)")
        done += got


def write_exact(fd: int, buf: memoryview, offset: int) -> None:
    done, n = 0, len(buf)
    while done < n:
        try:
            done += os.pwritev(fd, [buf[done:]], offset + done)
        except OSError as e:
            if e.errno == errno.EINVAL and _drop_direct(fd):
                continue
            raise


def run_blocks(blocks: Sequence[Block], workers: int, step: Callable[[int, Block], None]) -> None:
    """`step(worker, block)` for every block on `workers` threads, blocks taken in order (invariant 3)."""
    lock = threading.Lock()
    next_block = iter(blocks)
    failed: list[BaseException] = []

    def work(worker: int) -> None:
        while True:
            with lock:
                if failed:
                    return
                block = next(next_block, None)
            if block is None:
                return
            try:
                step(worker, block)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
                with lock:
                    failed.append(e)
                return

    threads = [threading.Thread(target=work, args=(w,), name=f"blockio-{w}") for w in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]


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


def default_workers() -> int:
    """Enough reads in flight to keep an NVMe busy, not more threads than the cores can feed (hashing)."""
    return max(2, min(16, os.cpu_count() or 2))
