"""Is there a usable NVIDIA GPU here? (cuda-python's driver API; no torch.)"""

from __future__ import annotations

import functools
import os


@functools.cache
def gpu_count() -> int:
    if os.environ.get("HF_FORCE_NO_GPU"):
        return 0
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]

        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return 0
        err, count = driver.cuDeviceGetCount()
        return int(count) if int(err) == 0 else 0
    except Exception:  # noqa: BLE001 - no cuda-python or no driver: no GPU
        return 0


def has_gpu() -> bool:
    return gpu_count() > 0
