"""Probe (device): where a mixed step's time goes (decode rows + prefill chunks), deterministic against default.

Why: under issue 17's recovery load on an H200 (8b, 64 streams + 16 late prompts, deterministic mode) a
successor's decode steps take 12-28 ms but its steps mixing ~390 prefill tokens into ~70 decode rows take
204-272 ms, and they set the largest gap a stream sees. This builds the batched engine's ModelRunner over random
weights of that shape (fused projections as the engine lays them out) and times such steps, then profiles one
with torch.profiler: the top ops by CUDA time and by CPU time, and how many kernels a step launches.

    python3 scripts/probe_mixed_step.py [SIZE] [DECODE] [CHUNKS] [CHUNK]     e.g. 8b@32 64 3 128
Prints JSON lines: one per mode with step times, then the profiler tables (text).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from engines.batched.fused_layout import FUSED
from engines.batched.model_runner import ModelRunner, RunItem
from engines.reference.config import get_config

BS = 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to check the script itself
DT = torch.bfloat16 if DEV == "cuda" else torch.float32


def weights(size: str) -> tuple[object, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    cfg = get_config(size)
    shapes = cfg.tensor_shapes()
    w: dict[str, torch.Tensor] = {}
    fused: dict[str, torch.Tensor] = {}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        for name, parts in FUSED.items():
            rows = sum(shapes[p + q][0] for q in parts)
            t = torch.empty(rows, shapes[p + parts[0]][1], device=DEV, dtype=DT).normal_(0, 0.02)
            fused[p + name] = t
            at = 0
            for q in parts:
                n = shapes[p + q][0]
                w[p + q] = t[at:at + n]
                at += n
    for name, shape in shapes.items():
        if name not in w:
            w[name] = torch.empty(shape, device=DEV, dtype=DT).normal_(0, 0.02)
    return cfg, w, fused


def items(n_decode: int, chunks: int, chunk: int, ctx: int = 160) -> list[RunItem]:
    out, block = [], 0
    for _ in range(n_decode):  # each at `ctx` positions already, one token now
        nb = -(-(ctx + 1) // BS)
        out.append(RunItem(token_ids=[7], start=ctx, block_table=list(range(block, block + nb)), sample=True))
        block += nb
    for j in range(chunks):  # chunks of prompts: the first from 0, the others from `chunk` on (a second chunk)
        start = 0 if j == 0 else chunk
        nb = -(-(start + chunk) // BS)
        out.append(RunItem(token_ids=[5] * chunk, start=start, block_table=list(range(block, block + nb)),
                           sample=j == 0))
        block += nb
    return out


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(runner: ModelRunner, its: list[RunItem], n: int = 6) -> list[float]:
    runner.run(its)
    sync()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        runner.run(its)
        sync()
        out.append(round((time.perf_counter() - t) * 1000, 2))
    return out


def main() -> None:
    args = sys.argv[1:]
    size = args[0] if args else "8b@32"
    n_decode, chunks, chunk = (int(a) for a in (args[1:4] if len(args) >= 4 else ("64", "3", "128")))
    cfg, w, fused = weights(size)
    kv = torch.zeros((cfg.n_layers, 2, 4096, BS, cfg.n_kv_heads, cfg.head_dim), device=DEV, dtype=DT)
    mixed = items(n_decode, chunks, chunk)
    decode = items(n_decode, 0, chunk)
    runners = {}
    for det in (True, False):
        r = ModelRunner(cfg, w, kv, BS, deterministic=det, cuda_graphs=False, max_num_seqs=256, fused=fused)
        runners[det] = r
        print(json.dumps({"size": size, "deterministic": det, "decode_rows": n_decode, "chunks": chunks,
                          "chunk": chunk, "mixed_step_ms": timed(r, mixed), "decode_step_eager_ms": timed(r, decode)}),
              flush=True)
    if DEV == "cuda":  # the same steps replayed from CUDA graphs (decode: its bucket; mixed: a mixed graph)
        for det in (True, False):
            r = ModelRunner(cfg, w, kv, BS, deterministic=det, cuda_graphs=True, max_num_seqs=256, fused=fused,
                            max_step_tokens=512)
            t = time.perf_counter()
            r.warmup()
            print(json.dumps({"size": size, "deterministic": det, "graphs": True, "mixed_graphs": len(r._mixed),
                              "capture_ms": round((time.perf_counter() - t) * 1000, 1),
                              "mixed_step_ms": timed(r, mixed), "decode_step_ms": timed(r, decode),
                              "graph_pool_mib": round(torch.cuda.memory_reserved() / 2**20)}), flush=True)
            del r
            torch.cuda.empty_cache()
    from torch.profiler import ProfilerActivity, profile

    for det in (True, False):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runners[det].run(mixed)
            sync()
        ev = prof.key_averages()
        kernels = sum(e.count for e in ev if getattr(getattr(e, "device_type", None), "name", "") == "CUDA")
        print(f"=== deterministic={det}: {kernels} kernels in one mixed step", flush=True)
        print(ev.table(sort_by="cuda_time_total", row_limit=18), flush=True)
        print(ev.table(sort_by="cpu_time_total", row_limit=18), flush=True)


if __name__ == "__main__":
    main()
