"""Probe (device): where a warm engine's prefill forward spends its time (no failure involved).

Builds the reference model with random weights on the GPU, warms it, then times a 28-token prefill:
launch (the Python call returning) and total (after a synchronize), on the main thread and on a new
thread; then one prefill under torch.profiler: the top ops by self CPU time and the synchronizing calls.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

from engines.reference.config import get_config
from engines.reference.model import Transformer


def build(size: str) -> tuple[Transformer, torch.Tensor]:
    cfg = get_config(size)
    dev = torch.device("cuda")
    w = {n: (torch.randn(shape, device=dev, dtype=torch.bfloat16) * 0.02) for n, shape in cfg.tensor_shapes().items()}
    kv = torch.zeros(cfg.kv_shape(1, 4096), device=dev, dtype=torch.bfloat16)
    return Transformer(cfg, w), kv[0]


def prefill(m: Transformer, kv: torch.Tensor, n: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    ids = torch.tensor(list(range(3, 3 + n)), dtype=torch.long, device=m.device)
    m.forward(ids, 0, kv)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return round((t1 - t0) * 1000, 2), round((t2 - t0) * 1000, 2)


def main(size: str) -> None:
    m, kv = build(size)
    for _ in range(3):
        prefill(m, kv, 28)
    main_thread = [prefill(m, kv, 28) for _ in range(5)]
    box: list = []
    t = threading.Thread(target=lambda: box.append(prefill(m, kv, 28)))
    t.start()
    t.join()
    decode = []
    for _ in range(5):
        t0 = time.perf_counter()
        m.forward(torch.tensor([5], device=m.device), 30, kv)
        torch.cuda.synchronize()
        decode.append(round((time.perf_counter() - t0) * 1000, 2))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill(m, kv, 28)
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:18]:
        rows.append((e.key, e.count, round(e.self_cpu_time_total / 1000, 2), round(getattr(e, "self_device_time_total", 0) / 1000, 2)))
    print(json.dumps({"size": size, "layers": m.cfg.n_layers, "prefill28_launch_total_ms_main": main_thread,
                      "prefill28_new_thread": box, "decode_ms": decode, "top_self_cpu": rows,
                      **graphed(m)}), flush=True)


def graphed(m: Transformer) -> dict:
    """The same prefill and decode through the engine's fixed-shape forwards, captured as CUDA graphs."""
    from engines.reference.engine import EngineCore

    kv = torch.zeros(m.cfg.kv_shape(2, 4096), device=m.device, dtype=m.dtype)
    core = EngineCore(m, kv, graphs=True)
    t0 = time.perf_counter()
    core.warm()
    capture_ms = round((time.perf_counter() - t0) * 1000, 1)

    def timed(fn) -> float:  # noqa: ANN001
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return round((time.perf_counter() - t) * 1000, 2)

    ctx = list(range(3, 31))
    prefill = [timed(lambda: core.forward(0, ctx, 0)) for _ in range(5)]
    decode = [timed(lambda: core.forward(0, [5], 30)) for _ in range(5)]
    return {"graphs_capture_ms": capture_ms, "graphs_prefill28_ms": prefill, "graphs_decode_ms": decode}


if __name__ == "__main__":
    for size in sys.argv[1:] or ["1b", "8b@39"]:
        main(size)
