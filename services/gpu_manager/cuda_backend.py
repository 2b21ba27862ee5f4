"""The cuda backend: VMM allocations (cuMemCreate) exported as POSIX fds. Every call is blocking; the manager
runs them on one dedicated thread, where the device's primary context is made current before each call."""

from __future__ import annotations

import contextlib
import logging
import os
import threading

from libs.client import cuda_driver as cd
from libs.client.protocol import OutOfMemory
from libs.common.errors import NotFound
from services.gpu_manager.backends import Chunk

cu = cd.cu
log = logging.getLogger("holdfast.gpu_manager.cuda")


class CudaBackend:
    name = "cuda"

    def __init__(self, gpus: list[str]) -> None:
        cd.init()
        selectors = gpus or [str(i) for i in range(cd.device_count())]
        self.ordinals = sorted({cd.ordinal_of(s) for s in selectors})
        self._ctx = {o: cd.primary_context(o) for o in self.ordinals}
        self._uuid = {o: cd.uuid_of(o) for o in self.ordinals}
        self._gran = {o: cd.granularity(o) for o in self.ordinals}
        self._total = {o: cd.total_memory(o) for o in self.ordinals}
        self._local = threading.local()

    def _use(self, gpu: int) -> None:
        self.check_gpu(gpu)
        if getattr(self._local, "gpu", None) != gpu:
            cd.check(cu.cuCtxSetCurrent(self._ctx[gpu]))
            self._local.gpu = gpu

    def check_gpu(self, gpu: int) -> None:
        if gpu not in self._ctx:
            raise NotFound(f"GPU {gpu} is not managed here (managed: {self.ordinals})")

    def granularity(self, gpu: int) -> int:
        self.check_gpu(gpu)
        return self._gran[gpu]

    def allocate(self, gpu: int, sizes: list[int], label: str) -> list[Chunk]:
        self._use(gpu)
        prop = cd.allocation_prop(gpu)
        chunks: list[Chunk] = []
        try:
            for size in sizes:
                try:
                    handle = cd.check(cu.cuMemCreate(size, prop, 0))
                except cd.CudaError as e:
                    if cd.is_oom(e):
                        raise OutOfMemory(f"GPU {gpu} has no {size} bytes free") from None
                    raise
                chunk = Chunk(size, -1, handle)
                chunks.append(chunk)
                chunk.fd = int(cd.check(cu.cuMemExportToShareableHandle(handle, cd.FD_HANDLE, 0)))
        except BaseException:
            self.free(chunks)
            raise
        return chunks

    def adopt(self, gpu: int, fds: list[int], sizes: list[int]) -> list[Chunk]:
        """After a restart: re-import the keeper's fds to get handles this process can release."""
        self._use(gpu)
        chunks = []
        for fd, size in zip(fds, sizes, strict=True):
            handle = cd.check(cu.cuMemImportFromShareableHandle(fd, cd.FD_HANDLE))
            chunks.append(Chunk(size, fd, handle))
        return chunks

    def free(self, chunks: list[Chunk]) -> None:
        for c in chunks:
            if c.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(c.fd)
                c.fd = -1
            if c.handle is not None:
                cd.check(cu.cuMemRelease(c.handle))
                c.handle = None

    def capacity(self, gpu: int) -> int:
        """The device's memory: an allocate past it is refused before any cuMemCreate (which would fail anyway,
        after creating chunks one by one up to the point of failure)."""
        self.check_gpu(gpu)
        return self._total[gpu]

    def gpu_uuid(self, gpu: int) -> str | None:
        return self._uuid.get(gpu)

    def nvlinks(self) -> dict[int, frozenset[int]]:
        """GPU -> the managed GPUs it reaches over NVLink (NVML's P2P status, NVLink index; through an NVSwitch too),
        found by UUID (NVML's order need not be CUDA's). {} where NVML is missing or refuses: placement then has
        no link to prefer, as on a node without NVLink."""
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - no NVML: no links known
            log.warning("NVML not available (%r): the GPUs' NVLinks are not published", e)
            return {}
        try:
            handle = {o: pynvml.nvmlDeviceGetHandleByUUID(self._uuid[o]) for o in self.ordinals}
            out: dict[int, frozenset[int]] = {}
            for a in self.ordinals:
                out[a] = frozenset(b for b in self.ordinals if b != a and pynvml.nvmlDeviceGetP2PStatus(
                    handle[a], handle[b], pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == pynvml.NVML_P2P_STATUS_OK)
            return {a: peers for a, peers in out.items() if peers}
        except Exception as e:  # noqa: BLE001 - an NVML error: no links known
            log.warning("NVLinks not read from NVML (%r): not published", e)
            return {}
        finally:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()

    def free_bytes(self, gpu: int) -> int | None:
        self._use(gpu)
        free, _total = cd.check(cu.cuMemGetInfo())
        return int(free)
