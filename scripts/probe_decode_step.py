"""Probe (device): where a decode step's time goes at a batch size, against its roofline: with the rope kernel
(paged_kernels.rope_) or torch's apply_rope, the residual add fused into the next RMSNorm (add_rms_norm_) or
not, and with another BLAS backend (cuBLASLt) if asked.

Why: issue 17 asks for decode at 64 streams >= 60% of the roofline; the engine serves 0.555-0.603 of it
(docs/benchmarks.md). This builds the batched engine's ModelRunner over random weights of the engine's layout
(scripts/probe_mixed_step.py `weights`), replays the decode graph of each batch size, and for each BLAS backend
reports the step's time and share of the roofline (bench/serve.py's bandwidth measure), then profiles one eager
step: CUDA time by kernel family (GEMM, attention, norm and activation, other) and the GEMMs' achieved bandwidth.

    python3 scripts/probe_decode_step.py [SIZE] [BATCHES] [CTX] [WAYS]   e.g. 8b 1,64,256 130 fused,unfused-add,torch-rope,cublaslt
Prints JSON lines. H200, 2026-12-04 (8b, ctx 130, batch 64): cuBLASLt 6.149 ms a graph step against cuBLAS's
6.118 (no gain); kernel time GEMMs 4.0 ms (84% of the bandwidth), attention 0.50, torch's rope ~0.43, norms 0.19.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from bench.serve import measure_bandwidth
from engines.batched.model_runner import ModelRunner, RunItem
from scripts.probe_mixed_step import BS, weights


def decode_items(batch: int, ctx: int) -> list[RunItem]:
    out, block = [], 0
    nb = -(-(ctx + 1) // BS)
    for _ in range(batch):
        out.append(RunItem(token_ids=[7], start=ctx, block_table=list(range(block, block + nb)), sample=True))
        block += nb
    return out


def step_ms(runner: ModelRunner, its: list[RunItem], n: int = 20) -> dict[str, float]:
    for _ in range(3):
        runner.run(its)
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        runner.run(its)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return {"p50": round(times[n // 2], 3), "min": round(times[0], 3)}


def family(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "_mm_")):
        return "gemm"
    if "attn" in n or "attention" in n or "paged" in n:
        return "attention"
    if any(k in n for k in ("norm", "silu", "rope", "rotary")):
        return "norm_act_rope"
    return "other"


def profile_step(runner: ModelRunner, its: list[RunItem]) -> dict[str, object]:
    from torch.profiler import ProfilerActivity, profile

    runner.run(its)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.run(its)
        torch.cuda.synchronize()
    fam: dict[str, float] = {}
    top: list[tuple[float, int, str]] = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if not us or e.count == 0:
            continue
        fam[family(e.key)] = fam.get(family(e.key), 0.0) + us
        top.append((us, e.count, e.key[:90]))
    top.sort(reverse=True)
    return {"kernel_us_by_family": {k: round(v) for k, v in sorted(fam.items(), key=lambda kv: -kv[1])},
            "top": [[round(us), n, k] for us, n, k in top[:14]]}


def main() -> None:
    args = sys.argv[1:]
    size = args[0] if args else "8b"
    batches = [int(b) for b in (args[1] if len(args) > 1 else "1,64,256").split(",")]
    ctx = int(args[2]) if len(args) > 2 else 130
    bw = measure_bandwidth("cuda")
    cfg, w, fused = weights(size)
    blocks = max(batches) * (-(-(ctx + 1) // BS)) + 16
    kv = torch.zeros((cfg.n_layers, 2, blocks, BS, cfg.n_kv_heads, cfg.head_dim), device="cuda", dtype=torch.bfloat16)
    gemm_bytes = sum(t.numel() * t.element_size() for n, t in w.items() if n not in ("tok_embeddings.weight",))
    print(json.dumps({"size": size, "ctx": ctx, "bandwidth_gb_s": round(bw / 1e9, 1),
                      "weights_gib_read_a_step": round(gemm_bytes / 2**30, 2)}), flush=True)
    from engines.batched import paged_kernels

    fits, add_norm = paged_kernels.rope_fits, paged_kernels.add_rms_norm_

    def add_then_norm(h: torch.Tensor, d: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return paged_kernels.rms_norm(h.add_(d), w, eps)  # two kernels, as before add_rms_norm_

    ways = (args[3] if len(args) > 3 else "fused,unfused-add,torch-rope").split(",")
    for lib in ways:
        torch.backends.cuda.preferred_blas_library("cublaslt" if lib == "cublaslt" else "cublas")
        paged_kernels.rope_fits = (lambda hd: False) if lib == "torch-rope" else fits  # type: ignore[assignment]
        paged_kernels.add_rms_norm_ = add_then_norm if lib in ("unfused-add", "torch-rope") else add_norm  # type: ignore[assignment]
        r = ModelRunner(cfg, w, kv, BS, deterministic=False, cuda_graphs=True, max_num_seqs=max(batches),
                        fused=fused, max_step_tokens=512)
        r.warmup()
        for b in batches:
            its = decode_items(b, ctx)
            t = step_ms(r, its)
            roof = r.roofline_step_s(b, ctx, bw) * 1000
            print(json.dumps({"blas": lib, "batch": b, "graph_step_ms": t, "roofline_ms": round(roof, 3),
                              "share_of_roofline": round(roof / t["p50"], 3),
                              "tokens_s": round(b / t["p50"] * 1000)}), flush=True)
        del r
        torch.cuda.empty_cache()
        e = ModelRunner(cfg, w, kv, BS, deterministic=False, cuda_graphs=False, max_num_seqs=max(batches), fused=fused)
        for b in batches:
            if b == 64:
                print(json.dumps({"blas": lib, "batch": b, "eager_step_ms": step_ms(e, decode_items(b, ctx), 8),
                                  **profile_step(e, decode_items(b, ctx))}), flush=True)
        del e
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
