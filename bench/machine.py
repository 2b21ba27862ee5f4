"""The machine a benchmark ran on, in its report: two lent GPU hosts of one kind differed by half in the engine's
no-failure step time (docs/benchmarks.md), so a figure without its host's CPU is not comparable."""

from __future__ import annotations

import glob
import os
import platform
import sys
from typing import Any


def _first(path: str, key: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == key:
                    return value.strip()
    except OSError:
        return None
    return None


def describe() -> dict[str, Any]:
    """CPU model and count (those this process may run on too), kernel, Python, and the NVIDIA GPUs' models from
    the driver's /proc files (none where there is no driver)."""
    gpus = [m for p in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")) if (m := _first(p, "Model"))]
    return {"cpu": _first("/proc/cpuinfo", "model name"), "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)), "kernel": platform.release(),
            "python": sys.version.split()[0], "gpus": gpus}
