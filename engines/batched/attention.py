"""Paged attention with grouped-query heads over one layer's KV: `[2 (k|v), num_blocks, block_size, kvh, hd]`.

A step's queries are the flat concatenation of its sequences' rows (`AttnMeta.query_starts`); sequence `i`
attends positions `< context_lens[i]` of its own blocks (`block_tables[i]`), its `n` query rows standing at
positions `context_lens[i] - n ..` (a prefill chunk is causal from that offset; a decode row sees all).

Two paths, chosen per sequence by its own shape and never by the batch's:
- reference (CPU, and on CUDA on request): per sequence, gather its blocks up to its context length, scores
  and softmax in float32, a causal mask offset for a chunk;
- CUDA: one query row (decode) -> the Triton paged-decode kernel; several rows (prefill chunks) -> the Triton
  paged-prefill kernel, every chunk of the step in one launch (paged_kernels.py). A mixed step's attention is
  two launches a layer whatever its sequences: before, one gather + SDPA per chunk (deterministic mode) or one
  padded SDPA over gathered and repeated heads (default mode) made a mixed step launch-bound (~1,100-2,000
  kernels; docs/engine-batched.md).
Chosen by scripts/bench_paged_attention.py on an H200 (8b shape, bf16, block 16): decode of 64 sequences at
4,096 positions in 0.31 ms (3.4 TB/s of KV), 256 at 2,048 in 0.59 ms, against 4.5-21 ms for gathering the
blocks and running SDPA.

Invariants:
1. Batch invariance by construction: every reduction of sequence `i` runs over its own rows and context only,
   in an order fixed by its own (rows, context length), so its output is bit-identical whatever else the batch
   holds. The decode kernel runs one program per (sequence, kv head), the prefill kernel one per (tile of
   PREFILL_ROWS rows of one sequence, kv head), each walking the context from position 0 in fixed steps; a
   key past a row's causal limit adds an exact zero, so a row's result does not depend on its tile's other rows
   or on where its tile's walk ends.
2. A row outside every sequence (graph padding) is written nowhere (`slot < 0` is skipped) and its output is 0.
3. `write_kv` runs before `attend` in each layer: a chunk's own keys are read back from the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

try:  # Triton ships with CUDA builds of torch only; the CPU path needs none of it.
    from engines.batched import paged_kernels
except ImportError:  # pragma: no cover - depends on the install
    paged_kernels = None  # type: ignore[assignment]


PREFILL_ROWS = 16  # query rows of one sequence that one program of the prefill kernel takes


@dataclass(frozen=True)
class AttnMeta:
    """What `attend` needs of a step's sequences. Host lists drive the per-sequence loops (the reference path and
    prefill chunks); the device tensors feed the decode kernel (and are all a CUDA graph reads)."""

    query_starts: list[int]  # B + 1 offsets into the flat rows
    context_lens: list[int]  # B
    block_tables: torch.Tensor  # [B, W] int64 on the KV's device; entries past a sequence's blocks are unread
    context_lens_t: torch.Tensor  # [B] int64 on the KV's device
    decode_only: bool  # every sequence has exactly one row (rows == sequences, in order)
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
    if not fast:
        out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for i in range(meta.num_seqs):
            lo, hi = meta.query_starts[i], meta.query_starts[i + 1]
            if hi > lo:
                keys, vals = gather(layer_kv, meta.block_tables[i], meta.context_lens[i])
                out[lo:hi] = reference_one(q[lo:hi], keys, vals).flatten(1)
        return out
    if "mixed" not in meta.cache:  # built once a step, not once a layer (a mixed graph's: at its capture)
        meta.cache["mixed"] = mixed_layout(meta, q.device)
    d, tiles = meta.cache["mixed"]
    out = torch.zeros_like(q)  # a row of no sequence (graph padding) stays 0
    if d:
        paged_kernels.paged_decode(q[:d], layer_kv, meta.block_tables[:d], meta.context_lens_t[:d], out=out[:d])
    paged_kernels.paged_prefill(q, out, layer_kv, meta.block_tables, tiles, PREFILL_ROWS)
    return out.flatten(1)


def mixed_layout(meta: AttnMeta, device: torch.device) -> tuple[int, torch.Tensor]:
    """A mixed step's attention work: its leading one-row sequences (the step's first rows, the decode kernel's)
    and the prefill kernel's tiles ([n, 4], on `device`) of every sequence after them. The model runner puts a
    step's one-token works first; a one-row sequence after a chunk (none in a runner's steps) would go through
    the prefill kernel, which computes it alike."""
    d = 0
    while d < meta.num_seqs and meta.query_starts[d + 1] - meta.query_starts[d] == 1:
        d += 1
    rest = [i for i in range(d, meta.num_seqs) if meta.query_starts[i + 1] > meta.query_starts[i]]
    tiles = torch.tensor(prefill_tiles(meta.query_starts, meta.context_lens, rest), dtype=torch.int64)
    return d, tiles.view(-1, 4).to(device, non_blocking=True)


def prefill_tiles(query_starts: list[int], context_lens: list[int], seqs: list[int]) -> list[int]:
    """The prefill kernel's work, flat (sequence, first row, rows, first position) quadruples: each of `seqs`'
    rows cut into tiles of PREFILL_ROWS from its own first row, so a tile holds one sequence and a row's tile
    depends on its own sequence alone."""
    out: list[int] = []
    for i in seqs:
        lo, n = query_starts[i], query_starts[i + 1] - query_starts[i]
        first = context_lens[i] - n
        for off in range(0, n, PREFILL_ROWS):
            out += (i, lo + off, min(PREFILL_ROWS, n - off), first + off)
    return out


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
