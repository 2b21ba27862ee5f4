"""A Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) over given tensors.

The model owns no parameters: it holds references to the tensors it is given (views over leased memory
in production), so building it over reattached memory copies nothing. Rotary embeddings use the
"rotate half" convention of Hugging Face's Llama, so the same weights give the same logits there
(hf_adapter.py relies on it).

Invariant: `forward` over one position at a time is a pure function of (weights, tokens so far); the
engine decodes that way by default so that a generation resumed from its context gives bit-identical
logits to an uninterrupted one (see engine.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engines.reference.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim))
    pos = torch.arange(cfg.max_seq, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv)
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_seq, head_dim]
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos/sin: [T, head_dim]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * c + rotate_half(x) * s


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        missing = [n for n in cfg.tensor_shapes() if n not in weights]
        if missing:
            raise ValueError(f"weights lack {len(missing)} tensors, e.g. {missing[:3]}")
        for name, shape in cfg.tensor_shapes().items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"{name}: shape {tuple(weights[name].shape)}, expected {shape}")
        self.cfg = cfg
        self.w = weights
        self.device = weights["tok_embeddings.weight"].device
        self.dtype = weights["tok_embeddings.weight"].dtype
        # in the weights' dtype once: apply_rope's casts are then no kernels (two per call otherwise)
        self.cos, self.sin = (t.to(self.dtype) for t in rope_tables(cfg, self.device))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, kv: torch.Tensor) -> torch.Tensor:
        """Logits (float32, [T, vocab]) for `tokens` at positions start.., writing their keys and values
        into `kv` ([layer, k|v, kv_head, position, head_dim], one slot of the cache)."""
        w = self.w
        T = tokens.shape[0]
        end = start + T
        if end > kv.shape[3]:
            raise ValueError(f"context of {end} tokens exceeds the cache ({kv.shape[3]})")
        h = F.embedding(tokens, w["tok_embeddings.weight"])
        cos, sin = self.cos[start:end], self.sin[start:end]
        mask = None
        if T > 1:
            q_pos = torch.arange(start, end, device=self.device)[:, None]
            k_pos = torch.arange(0, end, device=self.device)[None, :]
            mask = k_pos > q_pos  # [T, end]: True where a query may not look
        return self.layers(h, lambda x, p, i: self._attention(x, p, start, cos, sin, kv[i], mask))

    def layers(self, h: torch.Tensor, attend: Callable[[torch.Tensor, str, int], torch.Tensor]) -> torch.Tensor:
        """The decoder stack and the head over embeddings `h`; `attend(x, prefix, layer)` is the attention
        (this eager one, or static_forward.py's fixed-shape one)."""
        cfg, w = self.cfg, self.w
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            h = h + attend(rms_norm(h, w[p + "attention_norm.weight"], cfg.norm_eps), p, i)
            x = rms_norm(h, w[p + "ffn_norm.weight"], cfg.norm_eps)
            gate = F.silu(F.linear(x, w[p + "feed_forward.w1.weight"])) * F.linear(x, w[p + "feed_forward.w3.weight"])
            h = h + self.reduce(F.linear(gate, w[p + "feed_forward.w2.weight"]))
        h = rms_norm(h, w["norm.weight"], cfg.norm_eps)
        return F.linear(h, w["output.weight"]).float()

    def qkv(self, x: torch.Tensor, p: str, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries ([T, heads, hd]), keys and values ([T, kv_heads, hd]) of layer `p`, rotary applied."""
        cfg, w = self.cfg, self.w
        T, hd = x.shape[0], cfg.head_dim
        q = F.linear(x, w[p + "attention.wq.weight"]).view(T, cfg.n_heads, hd)
        k = F.linear(x, w[p + "attention.wk.weight"]).view(T, cfg.n_kv_heads, hd)
        v = F.linear(x, w[p + "attention.wv.weight"]).view(T, cfg.n_kv_heads, hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attention(self, x: torch.Tensor, p: str, start: int, cos: torch.Tensor, sin: torch.Tensor,
                   cache: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv(x, p, cos, sin)
        end = start + x.shape[0]
        cache[0, :, start:end] = k.transpose(0, 1).to(cache.dtype)
        cache[1, :, start:end] = v.transpose(0, 1).to(cache.dtype)
        keys = cache[0, :, :end].to(x.dtype)  # [kv_heads, end, hd]
        vals = cache[1, :, :end].to(x.dtype)
        return self.attend(q, keys, vals, mask, p)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None,
               p: str) -> torch.Tensor:
        """Grouped-query attention of `q` ([T, heads, hd]) over `keys`, `vals` ([kv_heads, S, hd]), `mask`
        ([T, S]) True where a query may not look, then layer `p`'s output projection."""
        cfg = self.cfg
        T, hd = q.shape[0], cfg.head_dim
        kvh, seq = keys.shape[0], keys.shape[1]
        rep = cfg.n_heads // kvh
        # query head h reads kv head h // rep (Hugging Face's repeat_kv): the queries grouped by the kv head
        # they read, [kvh, rep * T, hd], so the cache is read in place rather than copied once per query head
        # (a decode step's largest memory traffic after the weights); no host sync: graph-safe
        qg = q.transpose(0, 1).reshape(kvh, rep * T, hd)
        scores = torch.matmul(qg, keys.transpose(1, 2)).float() / math.sqrt(hd)  # [kvh, rep * T, S]
        if mask is not None:
            scores = scores.view(kvh, rep, T, seq).masked_fill(mask, float("-inf")).view(kvh, rep * T, seq)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, vals).view(cfg.n_heads, T, hd).transpose(0, 1).reshape(T, cfg.n_heads * hd)
        return self.reduce(F.linear(out, self.w[p + "attention.wo.weight"]))

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The output of a row-parallel projection (attention's `wo`, the feed-forward's `w2`): the whole sum here;
        a tensor-parallel rank holds a part of it and sums it over the ranks (tp.py)."""
        return x
