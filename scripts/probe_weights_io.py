"""Probe (device): how fast a weights file of a given size is made and read by a cold start, so that a large
`bench recovery` run is sized to fit the device tool's 10-minute calls. Prints one JSON line per step.

    python3 scripts/probe_weights_io.py 24 [dir]     (GiB; dir: where the file goes, default /dev/shm)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from bench.recovery import size_for
from engines.reference.config import get_config
from engines.reference.weights import load_weights, make_weights


def step(name: str, t0: float, **extra: object) -> None:
    print(json.dumps({"step": name, "s": round(time.perf_counter() - t0, 2), **extra}), flush=True)


def main(gib: float, where: Path) -> None:
    cfg = get_config(size_for("cuda", gib))
    path = where / f"probe-{os.getpid()}.safetensors"
    try:
        t0 = time.perf_counter()
        make_weights(cfg, path, device="cuda")
        size = path.stat().st_size / 2**30
        step("make", t0, size=cfg.name, gib=round(size, 2), cpus=os.cpu_count(),
             gib_per_s=round(size / (time.perf_counter() - t0), 2))
        t0 = time.perf_counter()
        w = load_weights(path, "cuda")
        torch.cuda.synchronize()
        step("load_to_cuda", t0, gib_per_s=round(size / (time.perf_counter() - t0), 2), tensors=len(w))
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main(float(sys.argv[1]), Path(sys.argv[2] if len(sys.argv) > 2 else "/dev/shm"))
