"""Microbenchmark of paged attention's CUDA paths at Llama-8B's attention shape, and of the model runner's
decode step (default vs deterministic mode, eager vs CUDA graphs); prints one JSON object.

    python3 scripts/bench_paged_attention.py [--size 8b@4] [--batches 1,16,64,256] [--ctx 512,2048]

Decode: the Triton paged kernel against gathering each batch's blocks into a contiguous padded tensor and
running SDPA (what a non-paged engine does per step), and against the reference path. Prefill chunks: gather
+ SDPA against the reference path. Times are medians of CUDA-event-timed repeats after warm-up, in ms.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.batched.attention import AttnMeta, attend, causal_mask, gather, reference_one  # noqa: E402
from engines.batched.memory import _fuse_local  # noqa: E402
from engines.batched.model_runner import ModelRunner, RunItem  # noqa: E402
from engines.reference.config import get_config  # noqa: E402

HEADS, KVH, HD, BS = 32, 8, 128, 16


def timed(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def paged(batch: int, ctx: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
    nb = -(-ctx // BS)
    layer_kv = torch.randn(2, batch * nb + 1, BS, KVH, HD, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(batch * nb, device="cuda").view(batch, nb)  # scattered blocks, as a real cache
    lens = [ctx] * batch
    starts = [i * rows for i in range(batch + 1)]
    meta = AttnMeta(starts, lens, tables, torch.tensor(lens, device="cuda"), decode_only=rows == 1)
    q = torch.randn(batch * rows, HEADS, HD, device="cuda", dtype=torch.bfloat16)
    return q, layer_kv, meta


def gather_sdpa_decode(q: torch.Tensor, layer_kv: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    keys, vals = zip(*(gather(layer_kv, meta.block_tables[i], c) for i, c in enumerate(meta.context_lens)),
                     strict=True)
    k = torch.stack(keys).transpose(1, 2)  # equal lengths here: no padding mask needed
    v = torch.stack(vals).transpose(1, 2)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)


def sdpa_chunk(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """The peer: one chunk through torch's fused attention (4-D inputs, a causal mask offset for the chunk)."""
    qh, k, v = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None]
    mask = ~causal_mask(q.shape[0], keys.shape[0], q.device)
    return F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)


def per_sequence(attn, q: torch.Tensor, layer_kv: torch.Tensor, meta: AttnMeta) -> None:
    for i in range(meta.num_seqs):
        lo, hi = meta.query_starts[i], meta.query_starts[i + 1]
        keys, vals = gather(layer_kv, meta.block_tables[i], meta.context_lens[i])
        attn(q[lo:hi], keys, vals)


def bench_attention(batches: list[int], ctxs: list[int], decode: bool = True) -> list[dict]:
    rows = []
    for ctx in ctxs:
        for batch in batches if decode else []:
            q, kv, meta = paged(batch, ctx, 1)
            row = {"kind": "decode", "batch": batch, "ctx": ctx,
                   "triton_ms": timed(partial(attend, q, kv, meta)),
                   "gather_sdpa_ms": timed(partial(gather_sdpa_decode, q, kv, meta))}
            if batch <= 16:
                row["reference_ms"] = timed(partial(attend, q, kv, meta, reference=True), 5)
            kv_bytes = batch * ctx * 2 * KVH * HD * 2
            row["triton_GBps"] = kv_bytes / row["triton_ms"] / 1e6
            rows.append(row)
        for chunk in (128, 512):
            if chunk > ctx:
                continue
            q, kv, meta = paged(4, ctx, chunk)
            rows.append({"kind": "prefill_chunk", "seqs": 4, "chunk": chunk, "ctx": ctx,
                         "attend_ms": timed(partial(attend, q, kv, meta)),
                         "gather_sdpa_ms": timed(partial(per_sequence, sdpa_chunk, q, kv, meta)),
                         "gather_reference_ms": timed(partial(per_sequence, reference_one, q, kv, meta)),
                         "reference_ms": timed(partial(attend, q, kv, meta, reference=True), 5)})
    return rows


def bench_runner(size: str, batches: list[int], ctx: int) -> list[dict]:
    cfg = get_config(size)
    weights = {n: torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02 for n, s in cfg.tensor_shapes().items()}
    nb = -(-ctx // BS) + 1
    blocks = max(batches) * nb
    kv = torch.zeros(cfg.n_layers, 2, blocks, BS, cfg.n_kv_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    bw = measured_bandwidth()
    out = []
    plain = dict(weights)
    fused = _fuse_local(weights)  # `weights`' q/k/v and w1/w3 become views of the fused tensors
    for det, graphs, fuse in ((False, True, False), (False, True, True), (True, True, True), (False, False, True)):
        runner = ModelRunner(cfg, weights if fuse else plain, kv, BS, deterministic=det, cuda_graphs=graphs,
                             max_num_seqs=max(batches), fused=fused if fuse else None)
        runner.warmup()
        for b in batches:
            items = [RunItem([1], ctx - 1, list(range(i * nb, (i + 1) * nb)), True) for i in range(b)]
            ms = timed(partial(runner.run, items), 10)
            out.append({"kind": "runner_decode", "size": size, "deterministic": det, "graphs": graphs, "fused": fuse,
                        "batch": b, "ctx": ctx, "step_ms": ms, "tokens_per_s": b / ms * 1e3,
                        "roofline_ms": runner.roofline_step_s(b, ctx, bw) * 1e3})
        runner = None  # its graphs' memory back before the next one captures
        torch.cuda.empty_cache()
    return out


def measured_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), 10)
    return 2 * x.numel() / (ms / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8b@4", help="model size for the runner's decode step (engines/reference)")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--ctx", default="512,2048")
    ap.add_argument("--skip-runner", action="store_true")
    ap.add_argument("--skip-decode", action="store_true", help="attention: prefill chunks only")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    ctxs = [int(x) for x in args.ctx.split(",")]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "attention": bench_attention(batches, ctxs, not args.skip_decode)}
    if not args.skip_runner:
        report["runner"] = bench_runner(args.size, batches, ctxs[0])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
