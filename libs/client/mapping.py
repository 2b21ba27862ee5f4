"""Mapping a lease's chunks into this process as one contiguous range, and views over it.

`RangeMapping` owns what every backend does alike: reserve the whole range, fill it (a lease's chunks back to back,
or a placeholder) or free it again if filling fails, adopt chunks into a placeholder's range, bounds, unmap once.
Each backend supplies only its calls:
- `HostMapping`: the range is an anonymous PROT_NONE mmap; each memfd chunk is mmapped over it (MAP_FIXED,
  MAP_SHARED): numpy arrays and torch CPU tensors are zero-copy views of the shared memory.
- `CudaMapping`: the range is device VA (cuMemAddressReserve); each POSIX fd is imported
  (cuMemImportFromShareableHandle) and mapped, then read-write access granted; torch CUDA tensors wrap the device
  pointer (zero copy).

Placeholders (`placeholder`): a warm standby reserves the range where it expects a predecessor's lease, backs it with
one small memory of its own mapped over and over (garbage content shared by every page: reads are harmless, nothing
depends on them), builds its model and captures its CUDA graphs over those addresses, and at the takeover `adopt`
maps the handed-on chunks at the same addresses. A captured kernel holds virtual addresses only; which physical
memory backs them is the page tables' business, changed by cuMemUnmap/cuMemMap (the property sleep/wake relies on
too).

Invariants:
1. `base` is the range's address from construction until `unmap`, then 0; a mapping whose filling failed is
   unmapped before the error leaves the constructor (nothing reserved is left behind).
2. `adopt` takes chunks whose sizes add up to the reserved size exactly, and only into a placeholder's range;
   anything else is refused before a page moves.

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
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from libs.common.errors import HoldfastError

# libc's mmap family, typed once for the package (direct_io.py maps and probes files with it too)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]  # direct_io.resident_share
MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_RESERVED = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE  # PROT_NONE over it: kept, not accessible


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int) -> int:
    out = libc.mmap(addr, size, prot, flags, fd, 0)
    if out == MAP_FAILED or out is None:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    return int(out)


class RangeMapping(ABC):
    """One contiguous range of this process's address space backing a lease (or a placeholder for one).
    Subclasses supply the abstract methods below, `device`, and (host only) `buffer`."""

    kind: str
    device: str  # where torch views of the range live ("cpu", "cuda:N")
    size: int
    base: int
    read_only: bool
    placeheld: bool  # backed by a placeholder (`placeholder`), not by a lease's chunks
    placeholder_bytes: int  # a placeholder's: the size of its memory mapped again and again
    adopt_ms: tuple[float, float] | None = None  # the last `adopt`: (placeholder dropped, chunks mapped), until read

    def __init__(self, fds: list[int], sizes: list[int], *, read_only: bool = False) -> None:
        self._open(sum(sizes), read_only, placeheld=False, fill=lambda: self.map_pages(fds, sizes))

    def _open(self, size: int, read_only: bool, *, placeheld: bool, fill: Callable[[], None]) -> None:
        """Reserve `size` bytes, then `fill` them; a failed fill frees the range (invariant 1)."""
        self.size, self.read_only, self.placeheld = size, read_only, placeheld
        self.base = self._reserve_range(size)
        try:
            fill()
        except BaseException:
            self.unmap()
            raise

    def adopt(self, fds: list[int], sizes: list[int], *, read_only: bool = False) -> None:
        """The placeholder gives way to a lease's chunks at the same addresses (invariant 2); `read_only`: a
        shadow of another engine's lease (`writable` once it is this process's)."""
        if not self.placeheld:
            raise HoldfastError("only a placeholder's range can adopt a lease's chunks")
        if sum(sizes) != self.size:
            raise HoldfastError(f"chunks of {sum(sizes)} bytes cannot replace a placeholder of {self.size}")
        t0 = time.perf_counter()
        self._drop_placeholder()
        self.placeheld, self.read_only = False, read_only
        t1 = time.perf_counter()
        self.map_pages(fds, sizes)
        self.adopt_ms = ((t1 - t0) * 1000, (time.perf_counter() - t1) * 1000)  # (placeholder dropped, chunks mapped)

    def map_pages(self, fds: list[int], sizes: list[int]) -> None:
        """Map chunks back to back at this mapping's addresses (at creation, on adopt, and on wake after a sleep:
        the same addresses, so pointers baked into captured CUDA graphs stay right)."""
        offset = 0
        for fd, size in zip(fds, sizes, strict=True):
            self._map_chunk(fd, offset, size)
            offset += size
        self._chunks_mapped()

    def writable(self) -> None:
        """A read-only mapping of chunks (a shadow taken over) becomes read-write, at the same addresses."""
        if self.read_only and not self.placeheld:
            self._grant_write()
        self.read_only = False

    def to_placeholder(self) -> None:
        """The chunks leave this range and the placeholder memory backs it again (a shadow dropped: the addresses
        stay reserved for the next one, and views over them read garbage again)."""
        if self.placeheld:
            return
        self._refill_placeholder()
        self.placeheld, self.read_only = True, False

    @property
    def ptr(self) -> int:
        return self.base

    def check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.size:
            raise HoldfastError(f"range [{offset}, {offset + nbytes}) is outside the lease ({self.size} bytes)")

    def buffer(self, offset: int, nbytes: int) -> Any:
        raise HoldfastError("numpy views need the host backend; on cuda use lease.torch(...)")

    def unmap(self) -> None:
        if self.base:
            self._free_range()
            self.base = 0

    # What each backend supplies.
    @abstractmethod
    def _reserve_range(self, size: int) -> int:
        """Keep `size` bytes of addresses, backed by nothing yet; returns the base."""

    @abstractmethod
    def _map_chunk(self, fd: int, offset: int, size: int) -> None:
        """Map one chunk's fd at `base + offset`."""

    @abstractmethod
    def _chunks_mapped(self) -> None:
        """After `map_pages` mapped every chunk."""

    @abstractmethod
    def _drop_placeholder(self) -> None:
        """Before `adopt` maps chunks over the placeholder."""

    @abstractmethod
    def release_pages(self) -> None:
        """Sleep: the pages leave this process, the range stays reserved (`map_pages` fills it again)."""

    @abstractmethod
    def _grant_write(self) -> None:
        """Read-write access over the whole range."""

    @abstractmethod
    def _refill_placeholder(self) -> None:
        """Unmap the chunks and map the placeholder memory over the range again."""

    @abstractmethod
    def _free_range(self) -> None:
        """Unmap whatever backs the range and give the addresses back."""

    @abstractmethod
    def torch_bytes(self, offset: int, nbytes: int) -> Any:
        """A uint8 torch tensor over `nbytes` at `offset`, zero copy."""


class HostMapping(RangeMapping):
    kind = "host"
    device = "cpu"

    @classmethod
    def placeholder(cls, size: int, placeholder_bytes: int, *, gpu: int = 0) -> HostMapping:
        """`size` bytes reserved, every page backed by one memfd of `placeholder_bytes` mapped again and again.
        `gpu` is not used: host memory belongs to no device (the parameter keeps one call for both backends)."""
        self = cls.__new__(cls)
        self.placeholder_bytes = placeholder_bytes
        self._open(size, False, placeheld=True, fill=lambda: self._fill_placeholder(placeholder_bytes))
        return self

    def _fill_placeholder(self, placeholder_bytes: int) -> None:
        fd = os.memfd_create("hf-placeholder", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, placeholder_bytes)
            for off in range(0, self.size, placeholder_bytes):
                _mmap(self.base + off, min(placeholder_bytes, self.size - off), mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_SHARED | _MAP_FIXED, fd)
        finally:
            os.close(fd)  # the mappings keep the memfd's pages; they go with the last of them

    def _reserve_range(self, size: int) -> int:
        return _mmap(None, size, 0, _RESERVED, -1)  # PROT_NONE (0) until the chunks are mapped over it

    def _map_chunk(self, fd: int, offset: int, size: int) -> None:
        # MAP_FIXED replaces what was there page for page (a placeholder's memory goes with its last mapping)
        prot = mmap.PROT_READ if self.read_only else mmap.PROT_READ | mmap.PROT_WRITE
        _mmap(self.base + offset, size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd)

    def _chunks_mapped(self) -> None:
        return None  # each chunk was mapped with its protection already

    def _drop_placeholder(self) -> None:
        return None  # the chunks are mapped over it: MAP_FIXED replaces it page for page

    def _grant_write(self) -> None:
        if libc.mprotect(ctypes.c_void_p(self.base), ctypes.c_size_t(self.size), mmap.PROT_READ | mmap.PROT_WRITE):
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect of {self.size} bytes failed: {os.strerror(err)}")

    def _refill_placeholder(self) -> None:
        self._fill_placeholder(self.placeholder_bytes)  # MAP_FIXED over the chunks, page for page

    def release_pages(self) -> None:
        """Sleep: the chunks' pages leave this process (their memory is freed once the manager and keeper let go
        too); the range stays reserved (PROT_NONE: a stray access faults rather than reads stale bytes)."""
        if self.base:
            _mmap(self.base, self.size, 0, _RESERVED | _MAP_FIXED, -1)

    def _free_range(self) -> None:
        libc.munmap(self.base, self.size)

    def buffer(self, offset: int, nbytes: int) -> Any:
        self.check_range(offset, nbytes)
        return (ctypes.c_ubyte * nbytes).from_address(self.base + offset)

    def torch_bytes(self, offset: int, nbytes: int) -> Any:
        import torch

        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.buffer(offset, nbytes), dtype=torch.uint8)


class CudaMapping(RangeMapping):
    kind = "cuda"
    ordinal: int
    handles: list[Any]  # this process's handles of the mapped chunks (or the placeholder's allocations)
    mapped: int  # bytes mapped from `base` on (what cuMemUnmap must cover)

    def __init__(self, fds: list[int], sizes: list[int], gpu_uuid: str | None, gpu: int, *,
                 read_only: bool = False) -> None:
        self._bind(local_ordinal(gpu_uuid, gpu))
        super().__init__(fds, sizes, read_only=read_only)

    def _bind(self, ordinal: int) -> None:
        from libs.client import cuda_driver as cd

        cd.init()
        self.ordinal, self.device = ordinal, f"cuda:{ordinal}"
        cd.primary_context(ordinal)

    @classmethod
    def placeholder(cls, size: int, placeholder_bytes: int, *, gpu: int = 0) -> CudaMapping:
        """`size` bytes of device VA reserved on GPU `gpu` (this process's ordinal), backed by one allocation of
        `placeholder_bytes` mapped again and again (and one of the granularity for a tail it does not divide):
        the same physical memory may back several VA ranges at once (virtual aliasing)."""
        from libs.client import cuda_driver as cd

        self = cls.__new__(cls)
        self._bind(gpu)
        gran = cd.granularity(gpu)
        if size % gran:
            raise HoldfastError(f"a reservation of {size} bytes is not a multiple of the granularity ({gran})")
        big = max(gran, min(size, placeholder_bytes) // gran * gran)
        self.placeholder_bytes = big
        self._open(size, False, placeheld=True, fill=lambda: self._fill_placeholder(big, gran))
        return self

    def _fill_placeholder(self, big: int, gran: int) -> None:
        from libs.client import cuda_driver as cd

        cu = cd.cu
        prop = cd.allocation_prop(self.ordinal)
        handles = {n: cd.check(cu.cuMemCreate(n, prop, 0)) for n in {big, gran}}
        self.handles = list(handles.values())
        for n in placeholder_runs(self.size, big, gran):
            cd.check(cu.cuMemMap(self.base + self.mapped, n, 0, handles[n], 0))
            self.mapped += n
        cd.check(cu.cuMemSetAccess(self.base, self.size, [cd.access_desc(self.ordinal)], 1))

    def _reserve_range(self, size: int) -> int:
        from libs.client import cuda_driver as cd

        self.handles, self.mapped = [], 0
        return int(cd.check(cd.cu.cuMemAddressReserve(size, 0, 0, 0)))

    def _map_chunk(self, fd: int, offset: int, size: int) -> None:
        from libs.client import cuda_driver as cd

        handle = cd.check(cd.cu.cuMemImportFromShareableHandle(fd, cd.FD_HANDLE))
        self.handles.append(handle)
        cd.check(cd.cu.cuMemMap(self.base + offset, size, 0, handle, 0))
        self.mapped = offset + size

    def _chunks_mapped(self) -> None:
        """Access for the whole range: read-only where asked and the driver grants it, else read-write."""
        from libs.client import cuda_driver as cd

        cu = cd.cu
        wanted, self.read_only = self.read_only, False
        if wanted:
            try:
                cd.check(cu.cuMemSetAccess(self.base, self.size, [cd.access_desc(self.ordinal, read_only=True)], 1))
                self.read_only = True
            except cd.CudaError:
                pass  # this driver/device grants device memory read-write only: see the module's note
        if not self.read_only:
            cd.check(cu.cuMemSetAccess(self.base, self.size, [cd.access_desc(self.ordinal)], 1))

    def _drop_placeholder(self) -> None:
        self.release_pages()  # unmapped (after every kernel that may read it finished) and released

    def _grant_write(self) -> None:
        from libs.client import cuda_driver as cd

        cd.check(cd.cu.cuMemSetAccess(self.base, self.size, [cd.access_desc(self.ordinal)], 1))

    def _refill_placeholder(self) -> None:
        from libs.client import cuda_driver as cd

        self.release_pages()
        self._fill_placeholder(self.placeholder_bytes, cd.granularity(self.ordinal))

    def release_pages(self) -> None:
        """Sleep: cuMemUnmap of the range and cuMemRelease of this process's handles, the VA reservation kept
        (cuMemAddressReserve'd; wake maps new chunks there). The physical memory is freed once the manager and
        keeper released theirs too."""
        from libs.client import cuda_driver as cd

        cd.check(cd.cu.cuCtxSynchronize())  # no kernel may still write through the range
        self._unmap_chunks()

    def _unmap_chunks(self) -> None:
        from libs.client import cuda_driver as cd

        cu = cd.cu
        if self.mapped:
            cd.check(cu.cuMemUnmap(self.base, self.mapped))
            self.mapped = 0
        for h in self.handles:
            cd.check(cu.cuMemRelease(h))
        self.handles = []

    def _free_range(self) -> None:
        from libs.client import cuda_driver as cd

        # Kernels may still be writing through this range: wait for them before the pages go away.
        with contextlib.suppress(cd.CudaError):
            cd.check(cd.cu.cuCtxSynchronize())
        self._unmap_chunks()
        cd.check(cd.cu.cuMemAddressFree(self.base, self.size))

    def torch_bytes(self, offset: int, nbytes: int) -> Any:
        import torch

        self.check_range(offset, nbytes)

        class _Bytes:  # the CUDA array interface: torch wraps the pointer without copying
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.base + offset, False),
                                        "version": 3, "strides": None}

        return torch.as_tensor(_Bytes(), device=self.device)


def placeholder_runs(size: int, big: int, small: int) -> list[int]:
    """The mapping sizes that cover `size` bytes: `big` while it fits, then `small` (which divides `size`)."""
    full = size // big
    return [big] * full + [small] * ((size - full * big) // small)


def local_ordinal(gpu_uuid: str | None, gpu: int) -> int:
    """This process's ordinal of the lease's GPU: CUDA_VISIBLE_DEVICES may number GPUs differently here."""
    from libs.client import cuda_driver as cd

    if gpu_uuid:
        cd.init()  # idempotent; the driver must be initialized before devices are counted
        for i in range(cd.device_count()):
            if cd.uuid_of(i) == gpu_uuid:
                return i
        raise HoldfastError(f"GPU {gpu_uuid} is not visible to this process")
    return gpu


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
