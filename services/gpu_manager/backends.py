"""Memory backends: where a lease's chunks come from, and how they are freed. Blocking calls: run off the loop.

- `host`: one memfd per chunk (memfd_create + ftruncate). An engine mmaps it; the memory lives while any fd
  or mapping of it does, exactly like exported GPU memory.
- `cuda`: cuMemCreate (pinned, device, POSIX-fd handle type) per chunk, exported with
  cuMemExportToShareableHandle. The manager keeps the allocation handle (to release it) and the fd (to
  hand out and to give the keeper). Memory is freed when the handle is released and every fd and every
  importer's mapping are gone.

Invariant: `free(chunks)` leaves this process with no fd and no handle of those chunks.
`capacity(gpu)`: the most bytes leases may hold on that gpu at once (host: a fraction of the host's or its
cgroup's memory; cuda: the device's memory); the session refuses an allocate past it (out_of_memory).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from libs.client.protocol import OutOfMemory, TooManyFds
from libs.common.errors import HoldfastError


@dataclass
class Chunk:
    size: int
    fd: int  # the shareable fd (memfd or exported POSIX fd), owned by the manager
    handle: Any = None  # cuda: CUmemGenericAllocationHandle


class Backend(Protocol):
    name: str

    def granularity(self, gpu: int) -> int: ...
    def check_gpu(self, gpu: int) -> None: ...
    def allocate(self, gpu: int, sizes: list[int], label: str) -> list[Chunk]: ...
    def adopt(self, gpu: int, fds: list[int], sizes: list[int]) -> list[Chunk]: ...
    def free(self, chunks: list[Chunk]) -> None: ...
    def gpu_uuid(self, gpu: int) -> str | None: ...
    def free_bytes(self, gpu: int) -> int | None: ...
    def capacity(self, gpu: int) -> int: ...


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def host_memory_bytes() -> int:
    """The memory this process may use: MemTotal, or its cgroup's limit (v2 memory.max, v1 limit_in_bytes)
    where that is lower (a container's share of a large host)."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    cgroups = Path("/sys/fs/cgroup")
    limits = [cgroups / "memory.max", cgroups / "memory/memory.limit_in_bytes"]
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, _, own = line.partition("::")  # cgroup v2: "0::/path"
            if hierarchy == "0" and own.strip("/"):
                limits.insert(0, cgroups / own.strip("/") / "memory.max")
    for limit in limits:
        with contextlib.suppress(OSError, ValueError):
            text = limit.read_text().strip()
            if text != "max":
                return min(total, int(text))
    return total


def exhausted_error(e: OSError, what: object) -> HoldfastError | None:
    """The typed reply for a call that ran out of fds or memory (the client learns, nothing else breaks), or
    None for any other error."""
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return TooManyFds(f"the gpu_manager has no fd left for {what} ({e.strerror})")
    if e.errno in (errno.ENOMEM, errno.ENOBUFS, errno.ENOSPC, errno.EFBIG):
        return OutOfMemory(f"no memory for {what} ({e.strerror})")
    return None


class HostBackend:
    name = "host"

    def __init__(self, capacity_bytes: int | None = None, capacity_fraction: float = 0.8) -> None:
        self._capacity = capacity_bytes if capacity_bytes is not None else int(host_memory_bytes() * capacity_fraction)

    def capacity(self, gpu: int) -> int:
        return self._capacity  # every "gpu" index of the host backend shares the host's memory

    def granularity(self, gpu: int) -> int:
        return mmap.PAGESIZE

    def check_gpu(self, gpu: int) -> None:
        if gpu < 0:
            raise ValueError("gpu must be >= 0")

    def allocate(self, gpu: int, sizes: list[int], label: str) -> list[Chunk]:
        chunks: list[Chunk] = []
        try:
            for i, size in enumerate(sizes):
                # the name shows in /proc/<pid>/fd, which is how tests (and operators) see who holds what
                fd = os.memfd_create(f"hf-{label}-{i}", os.MFD_CLOEXEC)
                chunks.append(Chunk(size, fd))
                os.ftruncate(fd, size)
        except OSError as e:
            self.free(chunks)
            typed = exhausted_error(e, f"{len(sizes)} chunks")
            if typed is None:
                raise
            raise typed from e
        except BaseException:
            self.free(chunks)
            raise
        return chunks

    def adopt(self, gpu: int, fds: list[int], sizes: list[int]) -> list[Chunk]:
        return [Chunk(size, fd) for fd, size in zip(fds, sizes, strict=True)]

    def free(self, chunks: list[Chunk]) -> None:
        for c in chunks:
            _close(c.fd)
            c.fd = -1

    def gpu_uuid(self, gpu: int) -> str | None:
        return None

    def free_bytes(self, gpu: int) -> int | None:
        return None


def cuda_available() -> bool:
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError:
        return False
    try:
        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return False
        err, count = driver.cuDeviceGetCount()
        return int(err) == 0 and count > 0
    except Exception:  # noqa: BLE001 - a broken driver install means no GPU here
        return False
