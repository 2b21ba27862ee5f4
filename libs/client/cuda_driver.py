"""Thin helpers over the CUDA driver API (cuda-python's `cuda.bindings.driver`), shared by the gpu_manager's
cuda backend and the engine SDK. Imported only where the cuda backend is in use."""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as cu  # type: ignore[import-not-found]

from libs.common.errors import HoldfastError

FD_HANDLE = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class CudaError(HoldfastError):
    code = "cuda_error"

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


def check(res: Any) -> Any:
    """Unwrap a driver call's (err, *values) tuple; raise CudaError on failure."""
    err = res[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise CudaError(f"CUDA driver error {name.decode() if isinstance(name, bytes) else name}", err)
    if len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


def is_oom(exc: CudaError) -> bool:
    return exc.result == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY


def init() -> None:
    check(cu.cuInit(0))


def device_count() -> int:
    return int(check(cu.cuDeviceGetCount()))


def uuid_of(ordinal: int) -> str:
    raw = bytes(check(cu.cuDeviceGetUuid(check(cu.cuDeviceGet(ordinal)))).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def total_memory(ordinal: int) -> int:
    """The device's memory in bytes (what the gpu_manager may lease on it at most)."""
    return int(check(cu.cuDeviceTotalMem(check(cu.cuDeviceGet(ordinal)))))


def ordinal_of(selector: str | int) -> int:
    """A device ordinal from an index or a UUID (as nvidia-smi prints it, 'GPU-' optional)."""
    if isinstance(selector, int) or str(selector).isdigit():
        return int(selector)
    want = str(selector).lower().removeprefix("gpu-")
    for i in range(device_count()):
        if uuid_of(i).lower().removeprefix("gpu-") == want:
            return i
    raise HoldfastError(f"no GPU with UUID {selector}")


def primary_context(ordinal: int) -> Any:
    """Retain the device's primary context (the one torch uses too) and make it current on this thread."""
    ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(ordinal))))
    check(cu.cuCtxSetCurrent(ctx))
    return ctx


def allocation_prop(ordinal: int) -> Any:
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = ordinal
    p.requestedHandleTypes = FD_HANDLE
    return p


def granularity(ordinal: int) -> int:
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(check(cu.cuMemGetAllocationGranularity(allocation_prop(ordinal), flag)))


def access_desc(ordinal: int, *, read_only: bool = False) -> Any:
    acc = cu.CUmemAccessDesc()
    acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = ordinal
    acc.flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only
                 else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    return acc
