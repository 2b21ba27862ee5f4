"""Paged attention with grouped-query heads over one layer's KV: `[2 (k|v), num_blocks, block_size, kvh, hd]`.

A step's queries are the flat concatenation of its sequences' rows (`AttnMeta.query_starts`); sequence `i`
attends positions `< context_lens[i]` of its own blocks (`block_tables[i]`), its `n` query rows standing at
positions `context_lens[i] - n ..` (a prefill chunk is causal from that offset; a decode row sees all).

Two paths, chosen per sequence by its own shape and never by the batch's:
- reference (CPU, and on CUDA on request): per sequence, gather its blocks up to its context length, scores
  and softmax in float32, a causal mask offset for a chunk;
- CUDA: one query row (decode) -> the Triton paged-decode kernel (paged_kernels.py); several rows (a prefill
  chunk) -> gather + SDPA, one sequence at a time.
Chosen by scripts/bench_paged_attention.py on an H200 (8b shape, bf16, block 16): decode of 64 sequences at
4,096 positions in 0.31 ms (3.4 TB/s of KV), 256 at 2,048 in 0.59 ms, against 4.5-21 ms for gathering the
blocks and running SDPA; prefill chunks of 512 rows over 4,096 positions in ~0.26 ms a sequence with gather +
SDPA, against 1.6 ms on the reference path (at 128 rows over 512 the two are even: the per-sequence launches
dominate; a Triton varlen prefill kernel is the next step if chunked prefill shows in the step time).

Invariants:
1. Batch invariance by construction: every reduction of sequence `i` runs over its own rows and context only,
   in an order fixed by its own (rows, context length), so its output is bit-identical whatever else the batch
   holds. The decode kernel runs one program per (sequence, kv head), walking the context in order.
2. A row outside every sequence (graph padding) is written nowhere (`slot < 0` is skipped) and its output is 0.
3. `write_kv` runs before `attend` in each layer: a chunk's own keys are read back from the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch only; the CPU path needs none of it.
    from engines.batched import paged_kernels
except ImportError:  # pragma: no cover - depends on the install
    paged_kernels = None  # type: ignore[assignment]


@dataclass(frozen=True)
class AttnMeta:
    """What `attend` needs of a step's sequences. Host lists drive the per-sequence loops (the reference path and
    prefill chunks); the device tensors feed the decode kernel (and are all a CUDA graph reads)."""

    query_starts: list[int]  # B + 1 offsets into the flat rows
    context_lens: list[int]  # B
    block_tables: torch.Tensor  # [B, W] int64 on the KV's device; entries past a sequence's blocks are unread
    context_lens_t: torch.Tensor  # [B] int64 on the KV's device
    decode_only: bool  # every sequence has exactly one row (rows == sequences, in order)
    batched_prefill: bool = False  # CUDA, default mode: every prefill chunk of the step in one padded SDPA call
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # index tensors built at the first layer

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def write_kv(layer_kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store rows' keys and values ([T, kvh, hd]) at their slots (`block * block_size + offset`; < 0: skip)."""
    if layer_kv.is_cuda and paged_kernels is not None:
        paged_kernels.store_kv(layer_kv, k, v, slot_mapping)
        return
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    kvh, hd = layer_kv.shape[-2:]
    layer_kv[0].view(-1, kvh, hd).index_copy_(0, slot_mapping, k.to(layer_kv.dtype))
    layer_kv[1].view(-1, kvh, hd).index_copy_(0, slot_mapping, v.to(layer_kv.dtype))


def attend(q: torch.Tensor, layer_kv: torch.Tensor, meta: AttnMeta, *, reference: bool = False) -> torch.Tensor:
    """Attention output ([T, heads * hd], q's dtype) of queries `q` ([T, heads, hd])."""
    fast = q.is_cuda and paged_kernels is not None and not reference
    if fast and meta.decode_only:
        return paged_kernels.paged_decode(q, layer_kv, meta.block_tables, meta.context_lens_t).flatten(1)
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    prefill: list[int] = []
    for i in range(meta.num_seqs):
        lo, hi = meta.query_starts[i], meta.query_starts[i + 1]
        if hi == lo:
            continue
        if fast and hi - lo == 1:
            decode_rows.append(lo)
            decode_seqs.append(i)
        elif fast and meta.batched_prefill:
            prefill.append(i)
        else:
            keys, vals = gather(layer_kv, meta.block_tables[i], meta.context_lens[i])
            if not fast:
                out[lo:hi] = reference_one(q[lo:hi], keys, vals).flatten(1)
                continue
            n, ctx = hi - lo, meta.context_lens[i]
            if n != ctx and ("mask", n, ctx) not in meta.cache:  # built once a step, not once a layer
                meta.cache["mask", n, ctx] = ~causal_mask(n, ctx, q.device)
            out[lo:hi] = sdpa_one(q[lo:hi], keys, vals, meta.cache.get(("mask", n, ctx))).flatten(1)
    if prefill:
        padded_prefill(q, layer_kv, meta, prefill, out)
    if decode_rows:
        if "decode" not in meta.cache:  # built once a step, not once a layer
            meta.cache["decode"] = (torch.tensor(decode_rows, device=q.device), torch.tensor(decode_seqs, device=q.device))
        rows, seqs = meta.cache["decode"]
        got = paged_kernels.paged_decode(q[rows], layer_kv, meta.block_tables[seqs], meta.context_lens_t[seqs])
        out[rows] = got.flatten(1)
    return out


def _padded_index(meta: AttnMeta, seqs: list[int], block_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """For the step's prefill chunks as one padded batch: each chunk's flat rows [S, N] (pads: row 0), the
    padded positions of real rows and their flat rows, the block tables [S, nb], the mask [S, 1, N, C] (True: may
    attend)."""
    n = [meta.query_starts[i + 1] - meta.query_starts[i] for i in seqs]
    ctx = [meta.context_lens[i] for i in seqs]
    N, nb = max(n), max(-(-c // block_size) for c in ctx)
    r = torch.arange(N)
    starts = torch.tensor([meta.query_starts[i] for i in seqs])[:, None]
    real = r[None, :] < torch.tensor(n)[:, None]
    rows = torch.where(real, starts + r[None, :], torch.zeros_like(starts))
    q_pos = torch.tensor(ctx)[:, None] - torch.tensor(n)[:, None] + r[None, :]  # [S, N]
    k_pos = torch.arange(nb * block_size)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    mask[~real] = False
    mask[..., 0] = True  # a padded row attends one key (an all-masked row is NaN); its output is dropped
    tables = meta.block_tables[torch.tensor(seqs, device=meta.block_tables.device), :nb]
    keep = real.flatten().nonzero().flatten()  # positions of real rows in the padded batch; on the host, once
    dest = rows.flatten()[keep]
    return rows.to(device), keep.to(device), dest.to(device), tables, mask[:, None].to(device)


def padded_prefill(q: torch.Tensor, layer_kv: torch.Tensor, meta: AttnMeta, seqs: list[int], out: torch.Tensor) -> None:
    """Every prefill chunk of the step in one SDPA call (CUDA, default mode): the per-sequence calls were
    ~6 launches a sequence a layer, most of a prefill step's time. Not batch-invariant (the padded shapes depend
    on the batch): the deterministic mode keeps `sdpa_one`."""
    bs, kvh, hd = layer_kv.shape[2:]
    if "prefill" not in meta.cache:
        meta.cache["prefill"] = _padded_index(meta, seqs, bs, q.device)
    rows, keep, dest, tables, mask = meta.cache["prefill"]
    S, N = rows.shape
    heads = q.shape[1]
    qp = q[rows.flatten()].view(S, N, heads, hd).transpose(1, 2)  # [S, H, N, hd]
    flat = tables.flatten()
    k = layer_kv[0].index_select(0, flat).view(S, -1, kvh, hd).transpose(1, 2).to(q.dtype)
    v = layer_kv[1].index_select(0, flat).view(S, -1, kvh, hd).transpose(1, 2).to(q.dtype)
    rep = heads // kvh
    if rep > 1:  # full heads: the memory-efficient kernel takes an arbitrary mask, not grouped heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask)  # [S, H, N, hd]
    o = o.transpose(1, 2).reshape(S * N, heads * hd)
    out.index_copy_(0, dest, o.index_select(0, keep))


def gather(layer_kv: torch.Tensor, table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values ([ctx, kvh, hd]) read through its block table."""
    bs, kvh, hd = layer_kv.shape[2:]
    nb = -(-ctx // bs)
    blocks = table[:nb]
    keys = layer_kv[0].index_select(0, blocks).view(nb * bs, kvh, hd)[:ctx]
    vals = layer_kv[1].index_select(0, blocks).view(nb * bs, kvh, hd)[:ctx]
    return keys, vals


def causal_mask(n: int, ctx: int, device: torch.device) -> torch.Tensor:
    """[n, ctx], True where query row r (at position ctx - n + r) may not look."""
    q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]
    return torch.arange(ctx, device=device)[None, :] > q_pos


def reference_one(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """One sequence: q [n, H, hd] over keys/vals [ctx, kvh, hd]; float32 scores and softmax; [n, H, hd]."""
    n, heads, hd = q.shape
    ctx, kvh = keys.shape[0], keys.shape[1]
    rep = heads // kvh
    # query head h reads kv head h // rep (Hugging Face's repeat_kv), grouped as [kvh, rep * n, hd]
    qg = q.float().transpose(0, 1).reshape(kvh, rep * n, hd)
    scores = torch.matmul(qg, keys.float().permute(1, 2, 0)) / math.sqrt(hd)  # [kvh, rep * n, ctx]
    if n > 1:
        mask = causal_mask(n, ctx, q.device)
        scores = scores.view(kvh, rep, n, ctx).masked_fill(mask, float("-inf")).view(kvh, rep * n, ctx)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vals.float().transpose(0, 1))  # [kvh, rep * n, hd]
    return out.view(heads, n, hd).transpose(0, 1).to(q.dtype)


def sdpa_one(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """One prefill chunk through torch's fused attention (CUDA): the same contract as `reference_one`. Inputs
    are 4-D ([1, heads, rows, hd]): with 3-D ones SDPA fell back to its math kernel, 10x slower on an H200
    (2.0 ms against 0.2 ms for 512 rows over 4,096 positions, bf16, 32/8 heads). `allowed`: the chunk's
    `~causal_mask` when the caller keeps it (one per step and shape, not one per layer)."""
    n, ctx = q.shape[0], keys.shape[0]
    qh = q.transpose(0, 1)[None]
    k, v = keys.transpose(0, 1).to(q.dtype)[None], vals.transpose(0, 1).to(q.dtype)[None]
    if n == ctx:  # a chunk from position 0: plain causal, which the flash kernel takes
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
    else:
        mask = ~causal_mask(n, ctx, q.device) if allowed is None else allowed
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)
