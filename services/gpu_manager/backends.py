"""Memory backends: where a lease's chunks come from, and how they are freed. Blocking calls: run off the loop.

- `host`: one memfd per chunk (memfd_create + ftruncate). An engine mmaps it; the memory lives while any fd
  or mapping of it does, exactly like exported GPU memory.
- `cuda`: cuMemCreate (pinned, device, POSIX-fd handle type) per chunk, exported with
  cuMemExportToShareableHandle. The manager keeps the allocation handle (to release it) and the fd (to
  hand out and to give the keeper). Memory is freed when the handle is released and every fd and every
  importer's mapping are gone.

Invariant: `free(chunks)` leaves this process with no fd and no handle of those chunks.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from typing import Any, Protocol


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


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class HostBackend:
    name = "host"

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


def make_backend(kind: str, gpus: list[str]) -> Backend:
    if kind == "auto":
        kind = "cuda" if cuda_available() else "host"
    if kind == "host":
        return HostBackend()
    if kind == "cuda":
        from services.gpu_manager.cuda_backend import CudaBackend

        return CudaBackend(gpus)
    raise ValueError(f"unknown backend {kind!r} (host, cuda or auto)")


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
