"""Parallel reads and writes of files, O_DIRECT where the filesystem takes it: the I/O under the gpu_manager's
artifacts and host tier (services/gpu_manager/blockio.py) and an engine's cold load of a weights file
(file_fill.py). Each worker is a loop of `os.preadv`/`os.pwritev`, which release the GIL.

Invariants:
1. A read asked to be exact reads every byte or fails: a short read is a truncated file (`ArtifactInvalid`).
2. A filesystem that takes O_DIRECT at open but refuses the I/O (EINVAL) gets the same call again, buffered.
3. `run_blocks`: the first failure stops every worker before its next block and is the one raised.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from libs.client.mapping import MAP_FAILED, libc  # libc's mmap family, typed once for the package
from libs.client.protocol import ArtifactInvalid

O_DIRECT = getattr(os, "O_DIRECT", 0)
ALIGN = 4096  # the largest logical block size of common devices: O_DIRECT offsets, lengths and buffers

T = TypeVar("T")


def resident_share(path: Path, offset: int = 0, nbytes: int | None = None) -> float:
    """The share of the file's pages in [offset, offset + nbytes) that sit in the page cache now: mincore over a
    mapping of the file that is never touched (no page is read). 0.0 where it cannot be told."""
    size = os.stat(path).st_size
    end = size if nbytes is None else min(size, offset + nbytes)
    start = offset - offset % mmap.PAGESIZE
    length = end - start
    if length <= 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr in (None, MAP_FAILED):
            return 0.0
        try:
            pages = -(-length // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, length, vec) != 0:
                return 0.0
            return 1.0 - bytes(vec).count(0) / pages  # a byte per page, its low bit set where the page is resident
        finally:
            libc.munmap(addr, length)
    finally:
        os.close(fd)


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


def read_upto(fd: int, buf: memoryview, offset: int) -> int:
    """Read into `buf` from `offset` until it is full or the file ends: the bytes read."""
    done, n = 0, len(buf)
    while done < n:
        try:
            got = os.preadv(fd, [buf[done:]], offset + done)
        except OSError as e:
            if e.errno == errno.EINVAL and _drop_direct(fd):
                continue
            raise
        if got <= 0:
            break
        done += got
    return done


def read_exact(fd: int, buf: memoryview, offset: int, what: str) -> None:
    n = len(buf)
    got = read_upto(fd, buf, offset)
    if got < n:
        raise ArtifactInvalid(f"{what}: ends {n - got} bytes early at {offset + got} (truncated)")


def write_exact(fd: int, buf: memoryview, offset: int) -> None:
    done, n = 0, len(buf)
    while done < n:
        try:
            done += os.pwritev(fd, [buf[done:]], offset + done)
        except OSError as e:
            if e.errno == errno.EINVAL and _drop_direct(fd):
                continue
            raise


def run_blocks(blocks: Iterable[T], workers: int, step: Callable[[int, T], None]) -> None:
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


def default_workers() -> int:
    """Enough reads in flight to keep an NVMe busy, not more threads than the cores can feed (hashing)."""
    return max(2, min(16, os.cpu_count() or 2))
