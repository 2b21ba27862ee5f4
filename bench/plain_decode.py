"""A plain torch batched decode of the reference model, for `holdfast bench serve --plain`: contiguous KV of
`ctx` positions per sequence, SDPA with GQA, one CUDA graph per batch size, no paging, no scheduler, no HTTP.
It is the yardstick the batched engine is measured against in the same run (what paging, scheduling and
serving cost on top of the bare forward)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engines.reference.config import get_config
from engines.reference.model import apply_rope, rms_norm, rope_tables
from engines.reference.weights import load_weights


def _step(cfg: Any, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, tok: torch.Tensor,
          pos: int, kv: torch.Tensor) -> torch.Tensor:
    """One decode step for every row of `tok` ([B]) at position `pos`; kv: [layers, 2, B, kvh, ctx, hd]."""
    B, hd = tok.shape[0], cfg.head_dim
    h = F.embedding(tok, w["tok_embeddings.weight"])
    c, s = cos[pos:pos + 1].expand(B, -1), sin[pos:pos + 1].expand(B, -1)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        x = rms_norm(h, w[p + "attention_norm.weight"], cfg.norm_eps)
        q = apply_rope(F.linear(x, w[p + "attention.wq.weight"]).view(B, cfg.n_heads, hd), c, s)
        k = apply_rope(F.linear(x, w[p + "attention.wk.weight"]).view(B, cfg.n_kv_heads, hd), c, s)
        v = F.linear(x, w[p + "attention.wv.weight"]).view(B, cfg.n_kv_heads, hd)
        kv[i, 0, :, :, pos] = k
        kv[i, 1, :, :, pos] = v
        o = F.scaled_dot_product_attention(q[:, :, None], kv[i, 0, :, :, : pos + 1], kv[i, 1, :, :, : pos + 1],
                                           enable_gqa=True)
        h = h + F.linear(o.reshape(B, cfg.n_heads * hd), w[p + "attention.wo.weight"])
        x = rms_norm(h, w[p + "ffn_norm.weight"], cfg.norm_eps)
        h = h + F.linear(F.silu(F.linear(x, w[p + "feed_forward.w1.weight"])) * F.linear(x, w[p + "feed_forward.w3.weight"]),
                         w[p + "feed_forward.w2.weight"])
    return F.linear(rms_norm(h, w["norm.weight"], cfg.norm_eps), w["output.weight"]).argmax(-1)


@torch.inference_mode()
def run_plain(weights: Path, size: str, batches: list[int], *, ctx: int = 512, steps: int = 20) -> list[dict[str, Any]]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = get_config(size)
    w = load_weights(weights, dev)
    dtype = w["tok_embeddings.weight"].dtype
    cos, sin = (t.to(dtype) for t in rope_tables(cfg, dev))
    out = []
    for B in batches:
        kv = torch.zeros((cfg.n_layers, 2, B, cfg.n_kv_heads, ctx, cfg.head_dim), dtype=dtype, device=dev)
        tok = torch.ones(B, dtype=torch.long, device=dev)
        pos = ctx - 1  # attention over the full context: the cost of a late decode step
        if dev.type == "cuda":
            for _ in range(2):
                _step(cfg, w, cos, sin, tok, pos, kv)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _step(cfg, w, cos, sin, tok, pos, kv)
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                graph.replay()
            torch.cuda.synchronize()
        else:
            _step(cfg, w, cos, sin, tok, pos, kv)
            t0 = time.perf_counter()
            for _ in range(steps):
                _step(cfg, w, cos, sin, tok, pos, kv)
        step_s = (time.perf_counter() - t0) / steps
        out.append({"batch": B, "ctx": ctx, "step_ms": round(step_s * 1000, 3), "tokens_per_s": round(B / step_s, 1)})
        del kv
    return out
