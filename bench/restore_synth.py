"""Weights made in the lease itself, for `holdfast bench restore`'s host-tier-only runs (`--from host[,host-bounce]
--no-first-token`): no weights file and no artifact, so the only copy in host memory is the tier's, and the largest
run is bounded by one copy of the weights in RAM (and one lease on the device), not two.

Each 64 MiB slice of the lease holds a pattern of its own (64-bit words `i * MULT + slice * STRIDE + 1`: every
word of the lease differs from its neighbours and from the same word of every other slice), written and checked
where the lease is (torch on the device, numpy on the host), a slice at a time: a check needs one slice of
memory, not a reference copy of the whole lease.

`host_only_room` says how large such a run may be on this machine: the tier's copy must fit in the host memory
available now (MemAvailable, or the cgroup's limit where lower) beside the process, and the lease in the device's
free memory (on the host backend the lease is host memory too: two copies there).
"""

from __future__ import annotations

import contextlib
from typing import Any

SLICE = 64 * 1024 * 1024
MULT = 0x9E3779B97  # < 2**36: i * MULT stays under 2**63 for a slice's 2**23 words
STRIDE = 0x100000000
GIB = 1024**3
HOST_HEADROOM = 8 * GIB  # the process (python, torch, CUDA), its pinned bounce buffers, the kernel's own
DEVICE_HEADROOM = 4 * GIB  # the CUDA context, a slice's pattern, torch's allocator


def slices(size: int) -> list[tuple[int, int, int]]:
    """(index, offset, bytes) of each slice of a lease of `size` bytes (a multiple of 8) (pure)."""
    return [(i, off, min(SLICE, size - off)) for i, off in enumerate(range(0, size, SLICE))]


def pattern(index: int, nbytes: int, device: str | None) -> Any:
    """Slice `index`'s bytes: a torch uint8 tensor on `device`, or a numpy array where `device` is None."""
    if device is None:
        import numpy as np

        return (np.arange(nbytes // 8, dtype=np.int64) * MULT + (index * STRIDE + 1)).view(np.uint8)
    import torch

    words = torch.arange(nbytes // 8, dtype=torch.int64, device=device).mul_(MULT).add_(index * STRIDE + 1)
    return words.view(torch.uint8)


def fill(mapping: Any, size: int) -> None:
    """Write every slice's pattern into a mapped lease (`libs.client.mapping`: cuda or host)."""
    for index, off, n in slices(size):
        if mapping.kind == "cuda":
            mapping.torch_bytes(off, n).copy_(pattern(index, n, "cuda"))
        else:
            import numpy as np

            np.frombuffer(mapping.buffer(off, n), dtype=np.uint8)[:] = pattern(index, n, None)
    if mapping.kind == "cuda":
        import torch

        torch.cuda.synchronize()  # written before the caller unmaps


def matches(mapping: Any, size: int) -> bool:
    """Whether a mapped lease holds every slice's pattern."""
    for index, off, n in slices(size):
        if mapping.kind == "cuda":
            import torch

            same = bool(torch.equal(mapping.torch_bytes(off, n), pattern(index, n, "cuda")))
        else:
            import numpy as np

            same = bool(np.array_equal(np.frombuffer(mapping.buffer(off, n), dtype=np.uint8), pattern(index, n, None)))
        if not same:
            return False
    return True


def host_available() -> int:
    """Host memory a new copy can take now: MemAvailable, or the cgroup's limit where lower."""
    from services.gpu_manager.backends import host_memory_bytes

    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return min(available, host_memory_bytes())


def host_only_room(backend: Any, gpu: int) -> dict[str, Any]:
    """The largest host-tier-only run here, in bytes, and what bounds it: `host` (the tier's copy in RAM; on the
    host backend the lease too) or `device` (the lease in the GPU's free memory)."""
    host = host_available()
    device = None
    with contextlib.suppress(Exception):  # a backend without the figure (host: None)
        device = backend.free_bytes(gpu)
    copies_in_host = 1 if backend.name == "cuda" else 2
    by_host = max(0, (host - HOST_HEADROOM) // copies_in_host)
    by_device = None if device is None else max(0, device - DEVICE_HEADROOM)
    bound = "device" if by_device is not None and by_device < by_host else "host"
    most = by_host if bound == "host" else by_device
    return {"host_available_gib": round(host / GIB, 2),
            "device_free_gib": None if device is None else round(device / GIB, 2),
            "max_bytes": int(most or 0), "max_gib": round((most or 0) / GIB, 2), "bound": bound,
            "headroom_gib": {"host": HOST_HEADROOM / GIB, "device": DEVICE_HEADROOM / GIB}}
