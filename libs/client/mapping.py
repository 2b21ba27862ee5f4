"""Mapping a lease's chunks into this process as one contiguous range, and views over it.

- `HostMapping`: reserve a contiguous range (PROT_NONE), then mmap each memfd chunk over it (MAP_FIXED,
  MAP_SHARED): numpy arrays and torch CPU tensors are zero-copy views of the shared memory.
- `CudaMapping`: import each POSIX fd (cuMemImportFromShareableHandle), reserve device VA, map the chunks
  back to back, grant read-write access; torch CUDA tensors wrap the device pointer (zero copy).

Placeholders (`HostMapping.placeholder`, `CudaMapping.placeholder`): a warm standby reserves the range where it
expects a predecessor's lease, backs it with one small memory of its own mapped over and over (garbage content shared
by every page: reads are harmless, nothing depends on them), builds its model and captures its CUDA graphs over those
addresses, and at the takeover `adopt` maps the handed-on chunks at the same addresses. A captured kernel holds
virtual addresses only; which physical memory backs them is the page tables' business, changed by
cuMemUnmap/cuMemMap (the property sleep/wake relies on too). Invariant: `adopt` takes chunks whose sizes add up to
the reserved size exactly; anything else is refused before a page moves.

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
        self._reserve(sum(sizes), read_only)
        try:
            self.map_pages(fds, sizes)
        except BaseException:
            self.unmap()
            raise

    def _reserve(self, size: int, read_only: bool) -> None:
        self.size = size
        self.read_only = read_only
        self.placeheld = False  # backed by a placeholder (`placeholder`), not by a lease's chunks
        # PROT_NONE (0): a reserved range, not accessible until the chunks are mapped over it
        self.base = _mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1)

    @classmethod
    def placeholder(cls, size: int, placeholder_bytes: int) -> HostMapping:
        """`size` bytes reserved, every page backed by one memfd of `placeholder_bytes` mapped again and again."""
        self = cls.__new__(cls)
        self._reserve(size, False)
        self.placeheld = True
        fd = os.memfd_create("hf-placeholder", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, placeholder_bytes)
            for off in range(0, size, placeholder_bytes):
                _mmap(self.base + off, min(placeholder_bytes, size - off), mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_SHARED | _MAP_FIXED, fd)
        except BaseException:
            self.unmap()
            raise
        finally:
            os.close(fd)  # the mappings keep the memfd's pages; they go with the last of them
        return self

    def adopt(self, fds: list[int], sizes: list[int]) -> None:
        """The placeholder gives way to a lease's chunks at the same addresses (MAP_FIXED replaces it page for
        page; its memory goes with its last mapping)."""
        check_adoptable(self, sizes)
        self.map_pages(fds, sizes)
        self.placeheld = False

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

        cd.init()
        self.ordinal = local_ordinal(gpu_uuid, gpu)
        cd.primary_context(self.ordinal)
        self._reserve(sum(sizes), read_only)
        try:
            self.map_pages(fds, sizes)
        except BaseException:
            self.unmap()
            raise

    def _reserve(self, size: int, read_only: bool) -> None:
        from libs.client import cuda_driver as cd

        self.size = size
        self.base = int(cd.check(cd.cu.cuMemAddressReserve(size, 0, 0, 0)))
        self.handles: list[Any] = []
        self.mapped = 0
        self.read_only = read_only
        self.placeheld = False  # backed by a placeholder (`placeholder`), not by a lease's chunks

    @classmethod
    def placeholder(cls, size: int, gpu: int, placeholder_bytes: int) -> CudaMapping:
        """`size` bytes of device VA reserved on GPU `gpu` (this process's ordinal), backed by one allocation of
        `placeholder_bytes` mapped again and again (and one of the granularity for a tail it does not divide):
        the same physical memory may back several VA ranges at once (virtual aliasing)."""
        from libs.client import cuda_driver as cd

        cu = cd.cu
        cd.init()
        self = cls.__new__(cls)
        self.ordinal = gpu
        cd.primary_context(gpu)
        gran = cd.granularity(gpu)
        if size % gran:
            raise HoldfastError(f"a reservation of {size} bytes is not a multiple of the granularity ({gran})")
        big = max(gran, min(size, placeholder_bytes) // gran * gran)
        self._reserve(size, False)
        self.placeheld = True
        try:
            prop = cd.allocation_prop(gpu)
            handles = {n: cd.check(cu.cuMemCreate(n, prop, 0)) for n in {big, gran}}
            self.handles = list(handles.values())
            off = 0
            for n in placeholder_runs(size, big, gran):
                cd.check(cu.cuMemMap(self.base + off, n, 0, handles[n], 0))
                off += n
                self.mapped = off
            cd.check(cu.cuMemSetAccess(self.base, size, [cd.access_desc(gpu)], 1))
        except BaseException:
            self.unmap()
            raise
        return self

    def adopt(self, fds: list[int], sizes: list[int]) -> None:
        """The placeholder gives way to a lease's chunks at the same addresses: unmapped (after every kernel that
        may read it finished) and released, then the chunks mapped as at creation."""
        check_adoptable(self, sizes)
        self.release_pages()
        self.placeheld = False
        self.map_pages(fds, sizes)

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


def placeholder_runs(size: int, big: int, small: int) -> list[int]:
    """The mapping sizes that cover `size` bytes: `big` while it fits, then `small` (which divides `size`)."""
    full = size // big
    return [big] * full + [small] * ((size - full * big) // small)


def check_adoptable(mapping: HostMapping | CudaMapping, sizes: list[int]) -> None:
    if not mapping.placeheld:
        raise HoldfastError("only a placeholder's range can adopt a lease's chunks")
    if sum(sizes) != mapping.size:
        raise HoldfastError(f"chunks of {sum(sizes)} bytes cannot replace a placeholder of {mapping.size}")


def local_ordinal(gpu_uuid: str | None, gpu: int) -> int:
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
