"""Mapping a lease's chunks into this process as one contiguous range, and views over it.

- `HostMapping`: reserve a contiguous range (PROT_NONE), then mmap each memfd chunk over it (MAP_FIXED,
  MAP_SHARED): numpy arrays and torch CPU tensors are zero-copy views of the shared memory.
- `CudaMapping`: import each POSIX fd (cuMemImportFromShareableHandle), reserve device VA, map the chunks
  back to back, grant read-write access; torch CUDA tensors wrap the device pointer (zero copy).

`read_only=True` (a warm standby's shadow of another engine's weights): PROT_READ on the host, where a
write faults; on cuda the driver is asked for read-only access and, where it refuses, the range is mapped
read-write and `read_only` says False (the engine then only promises not to write).

No torch import at module level: torch is optional and imported by the methods that need it.
Unmapping makes every view of the mapping invalid: the SDK unmaps only on release/close.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from typing import Any

from libs.common.errors import HoldfastError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int) -> int:
    out = _libc.mmap(addr, size, prot, flags, fd, 0)
    if out == _MAP_FAILED or out is None:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    return int(out)


class HostMapping:
    kind = "host"

    def __init__(self, fds: list[int], sizes: list[int], *, read_only: bool = False) -> None:
        self.size = sum(sizes)
        self.read_only = read_only
        # PROT_NONE (0): a reserved range, not accessible until the chunks are mapped over it
        self.base = _mmap(None, self.size, 0,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1)
        try:
            self.map_pages(fds, sizes)
        except BaseException:
            _libc.munmap(self.base, self.size)
            raise

    def map_pages(self, fds: list[int], sizes: list[int]) -> None:
        """Map chunks back to back at this mapping's addresses (at creation, and on wake after a sleep)."""
        prot = mmap.PROT_READ if self.read_only else mmap.PROT_READ | mmap.PROT_WRITE
        offset = 0
        for fd, size in zip(fds, sizes, strict=True):
            _mmap(self.base + offset, size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd)
            offset += size

    def release_pages(self) -> None:
        """Sleep: the chunks' pages leave this process (their memory is freed once the manager and keeper let go
        too); the range stays reserved (PROT_NONE: a stray access faults rather than reads stale bytes)."""
        if self.base:
            _mmap(self.base, self.size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1)

    @property
    def ptr(self) -> int:
        return self.base

    def buffer(self, offset: int, nbytes: int) -> Any:
        if offset < 0 or offset + nbytes > self.size:
            raise HoldfastError(f"range [{offset}, {offset + nbytes}) is outside the lease ({self.size} bytes)")
        return (ctypes.c_ubyte * nbytes).from_address(self.base + offset)

    def torch_bytes(self, offset: int, nbytes: int) -> Any:
        import torch

        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.buffer(offset, nbytes), dtype=torch.uint8)

    def unmap(self) -> None:
        if self.base:
            _libc.munmap(self.base, self.size)
            self.base = 0


class CudaMapping:
    kind = "cuda"

    def __init__(self, fds: list[int], sizes: list[int], gpu_uuid: str | None, gpu: int, *,
                 read_only: bool = False) -> None:
        from libs.client import cuda_driver as cd

        cu = cd.cu
        cd.init()
        self.ordinal = _local_ordinal(gpu_uuid, gpu)
        cd.primary_context(self.ordinal)
        self.size = sum(sizes)
        self.base = int(cd.check(cu.cuMemAddressReserve(self.size, 0, 0, 0)))
        self.handles: list[Any] = []
        self.mapped = 0
        self.read_only = read_only
        try:
            self.map_pages(fds, sizes)
        except BaseException:
            self.unmap()
            raise

    def map_pages(self, fds: list[int], sizes: list[int]) -> None:
        """Import and map chunks back to back at the reserved VA (at creation, and on wake: the same addresses,
        so pointers baked into captured CUDA graphs stay right)."""
        from libs.client import cuda_driver as cd

        cu = cd.cu
        offset = 0
        for fd, size in zip(fds, sizes, strict=True):
            handle = cd.check(cu.cuMemImportFromShareableHandle(fd, cd.FD_HANDLE))
            self.handles.append(handle)
            cd.check(cu.cuMemMap(self.base + offset, size, 0, handle, 0))
            offset += size
            self.mapped = offset
        wanted, self.read_only = self.read_only, False
        if wanted:
            try:
                cd.check(cu.cuMemSetAccess(self.base, self.size, [cd.access_desc(self.ordinal, read_only=True)], 1))
                self.read_only = True
            except cd.CudaError:
                pass  # this driver/device grants device memory read-write only: see the module's note
        if not self.read_only:
            cd.check(cu.cuMemSetAccess(self.base, self.size, [cd.access_desc(self.ordinal)], 1))

    def release_pages(self) -> None:
        """Sleep: cuMemUnmap of the range and cuMemRelease of this process's handles, the VA reservation kept
        (cuMemAddressReserve'd; wake maps new chunks there). The physical memory is freed once the manager and
        keeper released theirs too."""
        from libs.client import cuda_driver as cd

        cu = cd.cu
        cd.check(cu.cuCtxSynchronize())  # no kernel may still write through the range
        if self.mapped:
            cd.check(cu.cuMemUnmap(self.base, self.mapped))
            self.mapped = 0
        for h in self.handles:
            cd.check(cu.cuMemRelease(h))
        self.handles = []

    @property
    def ptr(self) -> int:
        return self.base

    def buffer(self, offset: int, nbytes: int) -> Any:
        raise HoldfastError("numpy views need the host backend; on cuda use lease.torch(...)")

    def torch_bytes(self, offset: int, nbytes: int) -> Any:
        import torch

        if offset < 0 or offset + nbytes > self.size:
            raise HoldfastError(f"range [{offset}, {offset + nbytes}) is outside the lease ({self.size} bytes)")

        class _Bytes:  # the CUDA array interface: torch wraps the pointer without copying
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.base + offset, False),
                                        "version": 3, "strides": None}

        return torch.as_tensor(_Bytes(), device=f"cuda:{self.ordinal}")

    def unmap(self) -> None:
        from libs.client import cuda_driver as cd

        cu = cd.cu
        if not self.base:
            return
        # Kernels may still be writing through this range: wait for them before the pages go away.
        with contextlib.suppress(cd.CudaError):
            cd.check(cu.cuCtxSynchronize())
        if self.mapped:
            cd.check(cu.cuMemUnmap(self.base, self.mapped))
        for h in self.handles:
            cd.check(cu.cuMemRelease(h))
        self.handles = []
        cd.check(cu.cuMemAddressFree(self.base, self.size))
        self.base = 0


def _local_ordinal(gpu_uuid: str | None, gpu: int) -> int:
    """This process's ordinal of the lease's GPU: CUDA_VISIBLE_DEVICES may number GPUs differently here."""
    from libs.client import cuda_driver as cd

    if gpu_uuid:
        for i in range(cd.device_count()):
            if cd.uuid_of(i) == gpu_uuid:
                return i
        raise HoldfastError(f"GPU {gpu_uuid} is not visible to this process")
    return gpu


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
