"""The model over a paged KV cache: one forward over a step's flat batch of works, then sampling.

A step is a list of `RunItem`s (one per scheduled work: tokens fed at positions `start..`, the sequence's block
table). Their rows are concatenated, one-token works first; the embeddings, the decoder layers (attention.py's
paged attention) run once over all rows, the head only over the rows that sample. Step inputs are built once on
the host into one pinned buffer and copied to the device in one non-blocking copy. On CUDA a decode-only step
replays a CUDA graph captured at the smallest batch-size bucket that holds it, and a mixed step (one-token rows
beside up to MIXED_CHUNKS prefill chunks, within the step budget `max_step_tokens`) the smallest mixed graph
that holds it, keyed (one-token rows, chunk rows), each padded (padding rows: slot -1; padding sequences:
context 0; padding tiles: no rows; so they write nothing and read nothing). A mixed step ran eagerly before:
~1,300 kernel launches at 8b, 43-78 ms of interpreter time against ~20 ms of GPU work. Any other step, and every
step on the CPU, runs eagerly.

Deterministic (batch-invariant) mode: each row's logits are bit-identical whatever else the batch holds.
- Linear layers and RMSNorm run over fixed tiles of rows (`tile` rows: 64 on CUDA, 16 on the CPU; the last
  tile padded with zeros), one kernel call per tile. A GEMM of one fixed shape reduces each output element in
  one fixed order (its kernel, tiling and split-K are chosen from the shape alone), and that order does not
  depend on the other rows' values or on the row's place in the tile (a row's dot products use only its own
  inputs). Without tiles, a step of 3 rows and one of 200 run differently-shaped GEMMs, which pick different
  kernels and reduction splits: last-bit differences that greedy decoding turns into different tokens.
- Rows of one-token works go through tiles of `tile` rows, rows of prefill chunks through tiles of
  `prefill_tile` (4x): the step's single-token works are put first, and a row's tile size is fixed by its own
  work's kind, which the scheduler sets from the sequence alone. The head's rows all take small tiles.
- With the fused projections (fused_layout.py) a layer runs one q|k|v GEMM and one gate|up GEMM; on CUDA RMSNorm
  and silu(gate)*up are Triton kernels of one program a row, batch-invariant without tiles.
- On the CPU transcendental elementwise functions are tiled too (RMSNorm's rsqrt, SiLU's exp, one SwiGLU per tile): on
  the CPU their vectorized and scalar paths round differently and an element's path depends on the tensor's
  size (a row's SiLU differed between a 2-row and a 16-row tensor). Attention is per sequence by construction
  (attention.py invariant 1); rope and residual adds are multiplications and additions, correctly rounded
  whatever the path; the embedding is a gather.
- Cost: a step of M rows computes ceil(M / tile) * tile rows in ceil(M / tile) GEMM calls per linear layer
  instead of one: at small batches the padding (a decode step of 1 row computes 64 on CUDA, though decode is
  bound by reading the weights, which is the same), at large ones the extra launches and the smaller GEMMs'
  lower efficiency; each tile re-reads every weight, so a decode step past one tile reads the weights
  ceil(M / tile) times. H200, 8b shape, ctx 512, graphs (scripts/bench_paged_attention.py, 2026-12): batch 1
  9.0 ms against 7.5 ms by default, batch 64 10.1 against 10.2, batch 256 34.9 against 18.0. The one-token tile
  is the engine's `deterministic_tile` (a multiple of 16): 256 makes a 256-row step cost the default mode's and a
  1-row step ~35% more (docs/engine-batched.md, "Deterministic mode"); the prefill tile stays 4x the default.

Async scheduling (engine.py): `launch` queues a greedy step and returns at once with a `Launched`: the argmax
is taken on the device, the sampled tokens copied without blocking into pinned host memory and read (one event
waited) by `Launched.tokens()`, normally one step later, after the next step was queued. A decode row whose
input token is the previous step's sample not read back yet (`RunItem.feed`: its row there) takes it from that
step's device tensor (one index_copy after the upload), so a step never waits for the previous one's tokens.

Invariants:
1. A pinned staging buffer is rewritten only after the copy that last read it is done (`_Staging.ready`, one
   event), so a non-blocking copy never reads a buffer being rewritten; `run` returns when its sampled tokens
   are on the host.
2. A row's KV goes to `block_table[p // block_size] * block_size + p % block_size` (the package's contract);
   rows never write outside the blocks their item names (checked before any kernel runs).
3. Sampling is engines/reference/engine.py's `sample`, seeded per (seed, position of the sampled token).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engines.batched.attention import PREFILL_ROWS, AttnMeta, attend, paged_kernels, prefill_tiles, write_kv
from engines.batched.cache_units import block_elements, cache_units, kv_shape
from engines.batched.fused_layout import FUSED
from engines.reference.config import ModelConfig
from engines.reference.engine import sample
from engines.reference.model import Transformer, apply_rope, rms_norm

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A mixed graph's one-token rows (multiples of the CUDA small tile) and prefill chunks' rows (of the prefill
# tile). Larger steps run eagerly: they are bound by the GPU, not by launches, and a graph padded to the next
# size computed up to twice their rows (H200, 256 streams: 14,955 decode tokens/s with graphs to 2,048 rows).
MIXED_DECODE = (0, 64, 128, 192, 256)
MIXED_PREFILL = (256, 512)
MIXED_CHUNKS = 32  # prefill chunks a mixed graph takes at most (a step with more runs eagerly)


class RunItemError(ValueError):
    """A work that cannot run: out of the context, a block table too short, a block outside the cache."""


@dataclass(frozen=True)
class RunItem:
    token_ids: Sequence[int]  # fed this step at positions start..
    start: int
    block_table: Sequence[int]  # the sequence's blocks, at least ceil((start + len(token_ids)) / block_size)
    sample: bool  # sample one token from the last row
    temperature: float = 0.0
    seed: int = 0
    feed: int = -1  # >= 0: the one token fed is row `feed` of the previous launched step's tokens (on the device)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class _Staging:
    """One pinned host buffer and one device buffer of int64; `upload(n)` copies the first n in one go.
    `ready()` before writing the host buffer: waits (almost never long) for the last upload to have read it."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.device = device
        pinned = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self.dev = self.host if device.type == "cpu" else torch.zeros(size, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None

    def ready(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def upload(self, n: int) -> None:
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()


class Launched:
    """A step queued on the device (`ModelRunner.launch`). `rows[i]`: item i's row in `dev` (None: it does not
    sample); `tokens()` waits for the copy to the host and gives each item's token (None where none)."""

    def __init__(self, dev: torch.Tensor, rows: list[int | None]) -> None:
        self.dev, self.rows = dev, rows
        if dev.is_cuda:
            self._host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
            self._host.copy_(dev, non_blocking=True)
            self._done: torch.cuda.Event | None = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = dev, None
        self._tokens: list[int | None] | None = None

    def tokens(self) -> list[int | None]:
        if self._tokens is None:
            if self._done is not None:
                self._done.synchronize()  # releases the interpreter while it waits
            vals = self._host.tolist()
            self._tokens = [None if r is None else vals[r] for r in self.rows]
        return self._tokens


def _sections(buf: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive views of `sizes` int64s, each starting 16-byte aligned: Triton compiles a kernel variant per
    pointer alignment it is given, so a section at an odd offset would cost a compile (~1 s) mid-serving."""
    out, at = [], 0
    for n in sizes:
        out.append(buf[at:at + n])
        at += n + (n & 1)
    return out


def _span(sizes: Sequence[int]) -> int:
    """The int64s `_sections` spans over `sizes`."""
    return sum(n + (n & 1) for n in sizes)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], kv: torch.Tensor, block_size: int, *,
                 deterministic: bool = False, cuda_graphs: bool = True, max_num_seqs: int = 256,
                 fused: dict[str, torch.Tensor] | None = None, max_step_tokens: int = 0,
                 deterministic_tile: int | None = None) -> None:
        self.model = Transformer(cfg, weights)  # checks the weights; its rope tables, in the weights' dtype
        self.cfg, self.w, self.device = cfg, weights, self.model.device
        self.fused = check_fused(cfg, weights, fused or {})
        # CUDA: RMSNorm and SwiGLU's product in one Triton kernel each (one program a row: batch-invariant)
        self.kern = paged_kernels if self.device.type == "cuda" and paged_kernels is not None else None
        self.units = cache_units(cfg)
        want = kv_shape(cfg, kv.shape[2] if kv.dim() == 6 else -1, block_size)
        if kv.dim() != 6 or tuple(kv.shape) != want:
            raise ValueError(f"kv cache shape {tuple(kv.shape)}, expected [{want[0]} units, 2, blocks, {block_size}, "
                             f"{want[4]}, {cfg.head_dim}] (cache_units.py)")
        if kv.device != self.device:
            raise ValueError(f"kv cache on {kv.device}, weights on {self.device}")
        self.kv, self.block_size, self.num_blocks = kv, block_size, kv.shape[2]
        self.deterministic = deterministic
        base = 64 if self.device.type == "cuda" else 16
        # On the CPU a tile must hold a whole number of 16-float vectors: SiLU's and rsqrt's vectorized and scalar
        # paths round differently, and a tile of 5 rows x 344 put a row's last elements on the scalar tail (seen:
        # a row's logits differed alone and among others). 16 rows make every tile's size a multiple of 16.
        if deterministic_tile is not None and (deterministic_tile < 16 or deterministic_tile % 16):
            raise ValueError(f"deterministic_tile must be a positive multiple of 16, got {deterministic_tile}")
        self.tile = deterministic_tile or base  # one-token rows (and the head's) per GEMM in deterministic mode
        # Deterministic: rows of multi-token works (prefill chunks) go through tiles 4x as tall as the default small
        # tile: a mixed step re-reads the weights a quarter as often. A row's tile size is fixed by its own work's
        # kind (a chunk or one token), which the scheduler sets from the sequence alone, so it stays batch-invariant.
        self.prefill_tile = 4 * base
        self._split: int | None = None  # rows [0, split) small tiles, the rest prefill tiles; None: all small
        self.max_num_seqs = max_num_seqs
        self.table_width = -(-cfg.max_seq // block_size)
        self.buckets = [b for b in GRAPH_BUCKETS if b <= max_num_seqs]
        self.use_graphs = cuda_graphs and self.device.type == "cuda" and paged_kernels is not None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Mixed steps' graphs, keyed (decode rows, prefill rows), both padded: decode rows to multiples of the small
        # tile, prefill rows to the prefill tile's multiples up to the step's token budget (none where it is 0).
        self.mixed_keys = [(d, p) for d in MIXED_DECODE if d <= max(max_num_seqs, 1) + self.tile - 1
                           for p in MIXED_PREFILL if p < max_step_tokens + self.prefill_tile]
        self._mixed: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._stage = _Staging(self.device, 1 << 12)
        self._feed_stage = _Staging(self.device, 2 * max(max_num_seqs, 1))

    # ---- arithmetic for the benchmark

    @property
    def kv_bytes_per_token(self) -> int:
        return block_elements(self.cfg, 1) * self.kv.element_size()

    def roofline_step_s(self, batch: int, ctx: int, bandwidth_bytes_s: float) -> float:
        """A decode step's lower bound: every weight read once (the embedding table only at the batch's rows) and
        each sequence's KV of `ctx` tokens read once, over `bandwidth_bytes_s`."""
        weights = sum(t.numel() * t.element_size() for n, t in self.w.items() if n != "tok_embeddings.weight")
        emb = self.w["tok_embeddings.weight"]
        weights += batch * emb.shape[1] * emb.element_size()
        return (weights + batch * ctx * self.kv_bytes_per_token) / bandwidth_bytes_s

    # ---- a step

    def run(self, items: Sequence[RunItem]) -> list[int | None]:
        """Run one step; the sampled token of each item that samples (None for the others)."""
        return self._sample(items, self.logits(items)) if items else []

    @torch.inference_mode()
    def launch(self, items: Sequence[RunItem], prev: Launched | None = None) -> Launched:
        """Queue one greedy step (every sampling item has temperature 0) and return without waiting for the
        device; items with `feed` take their token from `prev`'s. The argmax is `run`'s (the same logits)."""
        if any(it.sample and it.temperature > 0 for it in items):
            raise RunItemError("launch samples greedily only: a step with temperature > 0 goes through run()")
        raw, rows = self._raw_logits(items, None if prev is None else prev.dev)
        return Launched(torch.argmax(raw, dim=-1), rows)

    @torch.inference_mode()
    def logits(self, items: Sequence[RunItem]) -> torch.Tensor:
        """Run one step; the logits (float32, [items that sample, vocab]) of each sampling item's last row."""
        raw, rows = self._raw_logits(items, None)
        want = [r for r in rows if r is not None]
        # a copy either way: a graph's output is rewritten by the next replay
        return raw.clone() if want == list(range(raw.shape[0])) else raw[want]

    def _raw_logits(self, items: Sequence[RunItem], prev: torch.Tensor | None) -> tuple[torch.Tensor, list[int | None]]:
        """The step's logits rows (float32) and each item's row among them (None: it does not sample)."""
        for it in items:
            self._check(it)
            if it.feed >= 0 and (prev is None or len(it.token_ids) != 1 or it.feed >= prev.numel()):
                raise RunItemError(f"a fed item feeds one token from the previous step's {0 if prev is None else prev.numel()} rows")
        B = len(items)
        if B == 0:
            return torch.empty(0, self.cfg.vocab_size), []
        self._stage.ready()
        self._feed_stage.ready()
        if self._graph_for(B) is not None and all(len(it.token_ids) == 1 for it in items):
            self._gstage.ready()
            return self._replay(items, prev)[:B], [i if it.sample else None for i, it in enumerate(items)]
        # one-token works first (the decode kernel's rows; deterministic: the small tiles), chunks after; each
        # item's logits row mapped back to item order
        order = sorted(range(B), key=lambda i: len(items[i].token_ids) > 1)
        work = [items[i] for i in order]
        d = sum(len(it.token_ids) == 1 for it in work)
        key = self._mixed_for(work, d)
        if key is not None:
            logits, rows = self._replay_mixed(work, d, key, prev)
        else:
            logits, rows = self._eager(work, split=d, prev=prev), _sample_rows(work)
        at = dict(zip(order, rows, strict=True))
        return logits, [at[i] for i in range(B)]

    def _feed(self, items: Sequence[RunItem], first_rows: Sequence[int], tokens: torch.Tensor,
              prev: torch.Tensor | None) -> None:
        """Fed items' tokens (device `tokens`, uploaded already) taken from the previous step's on the device."""
        pairs = [(r, it.feed) for r, it in zip(first_rows, items, strict=True) if it.feed >= 0]
        if not pairs or prev is None:
            return
        n, st = len(pairs), self._feed_stage
        if 2 * n > st.host.numel():
            self._feed_stage = st = _Staging(self.device, 4 * n)
        st.host[:2 * n].copy_(torch.tensor([r for r, _ in pairs] + [j for _, j in pairs], dtype=torch.int64))
        st.upload(2 * n)
        tokens.index_copy_(0, st.dev[:n], prev.index_select(0, st.dev[n:2 * n]))

    def _check(self, it: RunItem) -> None:
        n = len(it.token_ids)
        if n == 0 or it.start < 0:
            raise RunItemError(f"a work feeds at least one token from a position >= 0 (got {n} at {it.start})")
        if it.end > self.cfg.max_seq:
            raise RunItemError(f"context of {it.end} tokens exceeds the model's {self.cfg.max_seq}")
        nb = -(-it.end // self.block_size)
        if len(it.block_table) < nb:
            raise RunItemError(f"{it.end} tokens need {nb} blocks, the block table has {len(it.block_table)}")
        used = it.block_table[:nb]
        if min(used) < 0 or max(used) >= self.num_blocks:
            raise RunItemError(f"block table names blocks outside 0..{self.num_blocks - 1}: {list(used)}")
        if not all(0 <= t < self.cfg.vocab_size for t in it.token_ids):
            raise RunItemError(f"token ids outside the vocabulary of {self.cfg.vocab_size}")

    def _host_rows(self, items: Sequence[RunItem]) -> tuple[list[int], list[int], list[int]]:
        """Tokens, positions and KV slots of every row, in order."""
        bs = self.block_size
        tokens = list(itertools.chain.from_iterable(it.token_ids for it in items))
        positions: list[int] = []
        slots: list[int] = []
        for it in items:
            bt = it.block_table
            positions.extend(range(it.start, it.end))
            slots.extend(bt[p // bs] * bs + p % bs for p in range(it.start, it.end))
        return tokens, positions, slots

    def _fill_tables(self, table: torch.Tensor, items: Sequence[RunItem], rows_of: Sequence[int] | None = None) -> None:
        """Write each item's used blocks at the start of its row of `table` ([>= B, W] host; item i's row
        `rows_of[i]`, default i); the rest unread. A row at a time through numpy: a third of the time of one flat
        index_copy built from a list (256 rows of 40 blocks: ~0.27 against ~0.83 ms of the step thread)."""
        host = table.numpy()
        bs = self.block_size
        for r, it in zip(range(len(items)) if rows_of is None else rows_of, items, strict=True):
            n = -(-it.end // bs)
            host[r, :n] = it.block_table[:n]

    def _eager(self, items: Sequence[RunItem], split: int | None = None, prev: torch.Tensor | None = None) -> torch.Tensor:
        tokens, positions, slots = self._host_rows(items)
        T, B = len(tokens), len(items)
        ends = [it.end for it in items]
        starts = [0, *itertools.accumulate(len(it.token_ids) for it in items)]
        heads = [starts[i + 1] - 1 for i, it in enumerate(items) if it.sample]
        W = max(-(-e // self.block_size) for e in ends)
        sizes = [T, T, T, B, len(heads), B * W]
        if _span(sizes) > self._stage.host.numel():
            self._stage = _Staging(self.device, 2 * _span(sizes))
        host = _sections(self._stage.host, sizes)
        for view, values in zip(host, (tokens, positions, slots, ends, heads), strict=False):
            view.copy_(torch.tensor(values, dtype=torch.int64))
        self._fill_tables(host[5].view(B, W), items)
        self._stage.upload(_span(sizes))
        tok, pos, slot, ctx, head, table = _sections(self._stage.dev, sizes)
        self._feed(items, starts[:-1], tok, prev)
        meta = AttnMeta(starts, ends, table.view(B, W), ctx, decode_only=T == B)
        self._split = split
        try:
            return self._forward(tok, pos, slot, meta, head)
        finally:
            self._split = None

    # ---- the forward

    def _rows(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, head: bool = False) -> torch.Tensor:
        """`fn` over the rows of x: at once, or (deterministic) one fixed-size tile at a time: the step's first
        `_split` rows in tiles of `tile`, the rest in tiles of `prefill_tile` (the head's rows: all small)."""
        if not self.deterministic or x.shape[0] == 0:
            return fn(x)
        M = x.shape[0]
        split = self._small_rows(M, head)
        head_rows, rest = self._tiled(fn, x[:split], self.tile), self._tiled(fn, x[split:], self.prefill_tile)
        if rest is None:
            assert head_rows is not None  # M > 0 rows: the head has at least one
            return head_rows
        return rest if head_rows is None else torch.cat([head_rows, rest])

    def _small_rows(self, M: int, head: bool) -> int:
        """How many of a step's first rows go in small tiles (the rest in prefill tiles): all of the head's."""
        return M if head or self._split is None else min(self._split, M)

    @staticmethod
    def _tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, t: int) -> torch.Tensor | None:
        M = x.shape[0]
        if M == 0:
            return None
        if M % t:
            x = F.pad(x, (0, 0, 0, t - M % t))
        return torch.cat([fn(x[i:i + t]) for i in range(0, x.shape[0], t)])[:M]

    def _linear(self, x: torch.Tensor, name: str, *, head: bool = False) -> torch.Tensor:
        w = self.fused.get(name)
        return self._mm(x, self.w[name] if w is None else w, head=head)

    def _mm(self, x: torch.Tensor, w: torch.Tensor, *, head: bool = False) -> torch.Tensor:
        """x @ w.T: at once, or (deterministic) in `_rows`' tiles, each tile's product written in place into one
        output over one padded copy of x: no pad and concatenation per tile and segment (a deterministic mixed
        step of the 8b model launched 2,610 kernels, 1,107 in the default mode: scripts/probe_mixed_step.py). The
        small tiles' padding goes before their rows, the prefill tiles' after theirs, so the result is one slice.
        A tile computes its rows the same way wherever in it they sit (the premise of the tiles themselves)."""
        if not self.deterministic or x.shape[0] == 0:
            return F.linear(x, w)
        M = x.shape[0]
        split = self._small_rows(M, head)
        small, big = self.tile, self.prefill_tile
        front, back = -split % small, -(M - split) % big
        xp = F.pad(x, (0, 0, front, back)) if front or back else x
        out = x.new_empty((front + M + back, w.shape[0]))
        wt = w.t()
        for i in range(0, front + split, small):
            torch.mm(xp[i:i + small], wt, out=out[i:i + small])
        for i in range(front + split, front + M + back, big):
            torch.mm(xp[i:i + big], wt, out=out[i:i + big])
        return out[front:front + M]

    def _norm(self, x: torch.Tensor, name: str, *, head: bool = False) -> torch.Tensor:
        w, eps = self.w[name], self.cfg.norm_eps
        if self.kern is not None:  # one program a row: batch-invariant without tiles
            return self.kern.rms_norm(x, w, eps)
        return self._rows(lambda rows: rms_norm(rows, w, eps), x, head=head)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its norm): on CUDA one kernel, the sum written over h (the residual stream, never read
        again as it was); otherwise the add, then `_norm`."""
        if self.kern is not None and h.stride(1) == 1:
            return h, self.kern.add_rms_norm_(h, delta, self.w[name], self.cfg.norm_eps)
        h = h + delta
        return h, self._norm(h, name)

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """SwiGLU. CUDA with w1/w3 fused: one projection, one kernel for silu(gate) * up, then w2. Otherwise tiled
        as a whole: SiLU's exp is not batch-invariant on the CPU (vectorized and scalar paths round differently,
        and which one an element takes depends on the tensor's size: seen on AVX-512)."""
        w2 = self.w[p + "feed_forward.w2.weight"]
        w13 = self.fused.get(p + "feed_forward.w13.weight")
        if w13 is not None and self.kern is not None:
            return self._mm(self.kern.silu_mul(self._mm(x, w13)), w2)
        if w13 is not None:
            f = self.cfg.ffn_dim
            return self._rows(lambda rows: F.linear(_silu_mul(F.linear(rows, w13), f), w2), x)
        w1, w3 = (self.w[p + f"feed_forward.{n}.weight"] for n in ("w1", "w3"))
        return self._rows(lambda rows: F.linear(F.silu(F.linear(rows, w1)) * F.linear(rows, w3), w2), x)

    def _qkv(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer i's q [T, heads, hd] and k, v [T, kv heads, hd], rope applied: with wq/wk/wv fused, one projection
        and one rope over q and k together (rope is elementwise: the same values as two calls)."""
        cfg, T, p = self.cfg, x.shape[0], f"layers.{i}."
        H, KV, hd = cfg.heads_at(i), cfg.kv_heads_at(i), cfg.head_dim
        if p + "attention.wqkv.weight" not in self.fused:
            q = apply_rope(self._linear(x, p + "attention.wq.weight").view(T, H, hd), cos, sin)
            k = apply_rope(self._linear(x, p + "attention.wk.weight").view(T, KV, hd), cos, sin)
            return q, k, self._linear(x, p + "attention.wv.weight").view(T, KV, hd)
        qkv = self._linear(x, p + "attention.wqkv.weight")
        if self.kern is not None and self.kern.rope_fits(hd):  # one kernel, in place, apply_rope's values
            self.kern.rope_(qkv, H + KV, hd, cos, sin)
            return (qkv[:, :H * hd].view(T, H, hd), qkv[:, H * hd:(H + KV) * hd].view(T, KV, hd),
                    qkv[:, (H + KV) * hd:].view(T, KV, hd))
        qk = apply_rope(qkv[:, :(H + KV) * hd].view(T, H + KV, hd), cos, sin)
        return qk[:, :H], qk[:, H:], qkv[:, (H + KV) * hd:].view(T, KV, hd)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, meta: AttnMeta,
                 head_rows: torch.Tensor | None) -> torch.Tensor:
        """Logits (float32) of `head_rows` (None: every row)."""
        cfg = self.cfg
        h = F.embedding(tokens, self.w["tok_embeddings.weight"])
        cos, sin = self.model.cos[positions], self.model.sin[positions]
        x = self._norm(h, "layers.0.attention_norm.weight")
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            q, k, v = self._qkv(x, i, cos, sin)
            h, x = self._add_norm(h, self._reduce(self._linear(self._attention(i, q, k, v, slots, meta),
                                                               p + "attention.wo.weight")), p + "ffn_norm.weight")
            delta = self._reduce(self._mlp(x, p))
            if i + 1 < cfg.n_layers:
                h, x = self._add_norm(h, delta, f"layers.{i + 1}.attention_norm.weight")
            else:
                h = h + delta  # the final norm: the sampled rows' alone
        if head_rows is not None:
            h = h[head_rows]
        return self._linear(self._norm(h, "norm.weight", head=True), "output.weight", head=True).float()

    def _attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                   meta: AttnMeta) -> torch.Tensor:
        """Layer i's keys and values written into its cache and its attention's output [T, heads * hd]: one call over
        the layer's cache unit, or (a rank of an uneven group, cache_units.py) one per unit, each over its kv heads
        and the query heads that attend to them, their outputs side by side in head order."""
        units = self.units.of(i)
        if len(units) == 1:
            write_kv(self.kv[units[0]], k, v, slots)
            return attend(q, self.kv[units[0]], meta)
        g = self.units.heads
        rep = q.shape[1] // k.shape[1]
        outs = []
        for j, u in enumerate(units):
            write_kv(self.kv[u], k[:, j * g:(j + 1) * g], v[:, j * g:(j + 1) * g], slots)
            outs.append(attend(q[:, j * g * rep:(j + 1) * g * rep], self.kv[u], meta))
        return torch.cat(outs, dim=1)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output made whole: one rank holds all of it (tp.py sums the ranks' parts)."""
        return x

    def _sample(self, items: Sequence[RunItem], logits: torch.Tensor) -> list[int | None]:
        """engine.py's `sample` per sampling row; greedy rows' argmax taken in one call (the same argmax)."""
        out: list[int | None] = [None] * len(items)
        idx = [i for i, it in enumerate(items) if it.sample]
        if not idx:
            return out
        # Greedy rows' argmax where the logits are (launch's, the same), so that only their tokens cross to the
        # host: copying every row's logits (64 x 128k floats, 32 MB at 8b) and taking the argmax on the CPU cost
        # each synchronous step (a recovery's first ones) several ms of the interpreter's time.
        greedy = [j for j, i in enumerate(idx) if items[i].temperature <= 0]
        if greedy:
            picked = logits if len(greedy) == len(idx) else logits[greedy]
            # .cpu() waits for the step with the interpreter released (tolist() on a device tensor would hold it)
            for j, tok in zip(greedy, torch.argmax(picked, dim=-1).cpu().tolist(), strict=True):
                out[idx[j]] = tok
        hot = [j for j, i in enumerate(idx) if items[i].temperature > 0]
        rows = logits[hot].cpu() if hot else None
        for k, j in enumerate(hot):
            it = items[idx[j]]
            assert rows is not None
            out[idx[j]] = sample(rows[k:k + 1], it.temperature, it.seed, it.end)
        return out

    # ---- CUDA graphs of decode-only steps

    def warmup(self) -> None:
        """Compile and tune once before serving: an eager decode-shaped forward, then (CUDA) the graphs."""
        self.capture_graphs()

    def _graph_inputs(self) -> list[int]:
        n = self.buckets[-1]
        return [n, n, n, n, n * self.table_width]  # tokens, positions, slots, context lengths, block tables

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    @torch.inference_mode()
    def capture_graphs(self, buckets: Sequence[int] | None = None) -> None:
        """Capture the decode graphs of `buckets` (default: all) not captured yet. May be called again for more:
        every graph reads the same staging buffer and shares one memory pool."""
        want = sorted(set(self.buckets if buckets is None else buckets) & set(self.buckets) - set(self._graphs),
                      reverse=True)
        if self.use_graphs and buckets is not None and not want:
            return  # captured already (a prepared standby's, before its takeover): nothing to stage or wait for
        sizes = self._graph_inputs()
        n = self.buckets[-1]
        if getattr(self, "_gstage", None) is None:
            self._gstage = _Staging(self.device, _span(sizes))
            self._gpool: Any = None
        tok, pos, slot, ctx, table = _sections(self._gstage.dev, sizes)
        slot.fill_(-1)  # padding everywhere while capturing: nothing written, nothing read
        ctx.zero_()
        self._gstage.host.copy_(self._gstage.dev.cpu())
        table = table.view(n, self.table_width)
        if not self.use_graphs:
            meta = AttnMeta([0, 1], [0], table[:1], ctx[:1], decode_only=True)
            self._forward(tok[:1], pos[:1], slot[:1], meta, None)
            return
        for b in want:
            meta = AttnMeta([], [], table[:b], ctx[:b], decode_only=True)
            self._forward(tok[:b], pos[:b], slot[:b], meta, None)  # compiles, tunes, allocates outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._gpool):
                logits = self._forward(tok[:b], pos[:b], slot[:b], meta, None)
            graph.replay()  # `_warm_launch`
            self._gpool = graph.pool()
            self._graphs[b] = (graph, logits)
        if buckets is None:
            self._capture_mixed()
        self._warm_launch()
        torch.cuda.synchronize()

    def _warm_launch(self) -> None:
        """What a step's launch would otherwise do for the first time on the serving path, done once here: a
        captured graph's first launch uploads it to the device (each is replayed once right after its capture, over
        the padding it was captured with: nothing is written); the kernels a step runs beside its graph (the
        argmax, the sampled rows' gather, the fed tokens' select and copy) are loaded by CUDA at their first launch
        (lazy module loading: a process's first argmax took 6 ms of the launching thread's CPU on an H100); and
        `Launched`'s pinned host buffer of a new size class is a cudaHostAlloc (one of each class a step's sampled
        rows can need is allocated and given back to torch's pinned cache). An engine's first step after its
        start (H100, tiny model, 8 rows: its launch 9.05 -> 0.44 ms) or after a takeover with graphs captured then;
        a prepared standby (__main__.py `prepare_runner`) has run these in its own warm-up (a successor's step 1
        is its ~7 ms of GPU time, docs/results/h100-s44-2026-12-06)."""
        rows = 1
        while True:
            torch.empty(rows, dtype=torch.int64, pin_memory=True)
            if rows >= self.max_num_seqs + MIXED_CHUNKS:
                break
            rows *= 2
        outs = [logits for _, logits in self._graphs.values()] + ([self._mixed_out] if self._mixed else [])
        for logits in outs:  # each shape a step's argmax can take from a graph; scratch results only
            Launched(torch.argmax(logits, dim=-1), []).tokens()
            logits[[0]].cpu()
        at = torch.zeros(1, dtype=torch.int64, device=self.device)
        scratch = torch.zeros(2, dtype=torch.int64, device=self.device)
        scratch.index_copy_(0, at, scratch.index_select(0, at))

    def _graph_for(self, n: int) -> int | None:
        """The smallest captured bucket that holds `n` rows (None: run eagerly)."""
        return min((b for b in self._graphs if b >= n), default=None)

    def _replay(self, items: Sequence[RunItem], prev: torch.Tensor | None = None) -> torch.Tensor:
        B = len(items)
        b = self._graph_for(B)
        assert b is not None
        n = self.buckets[-1]
        tokens, positions, slots = self._host_rows(items)
        tok, pos, slot, ctx, table = _sections(self._gstage.host, self._graph_inputs())
        pad = b - B
        tok[:b].copy_(torch.tensor(tokens + [0] * pad, dtype=torch.int64))
        pos[:b].copy_(torch.tensor(positions + [0] * pad, dtype=torch.int64))
        slot[:b].copy_(torch.tensor(slots + [-1] * pad, dtype=torch.int64))
        ctx[:b].copy_(torch.tensor([it.end for it in items] + [0] * pad, dtype=torch.int64))
        self._fill_tables(table.view(n, self.table_width), items)
        self._gstage.upload(self._gstage.host.numel())
        self._feed(items, range(B), self._gstage.dev[:n], prev)
        graph, logits = self._graphs[b]
        graph.replay()
        return logits

    # ---- CUDA graphs of mixed steps (one-token rows, then prefill chunks)

    def _mixed_inputs(self) -> list[int]:
        d = max((k[0] for k in self.mixed_keys), default=0)
        p = max((k[1] for k in self.mixed_keys), default=0)
        seqs = d + MIXED_CHUNKS
        # tokens, positions, slots (rows) | context lengths (sequences) | block tables | prefill tiles | head rows
        return [d + p, d + p, d + p, seqs, seqs * self.table_width, 4 * (p // PREFILL_ROWS + MIXED_CHUNKS), seqs]

    def _mixed_for(self, work: Sequence[RunItem], d: int) -> tuple[int, int] | None:
        """The smallest captured mixed graph that holds this step (decode rows first), None: run it eagerly."""
        chunks = len(work) - d
        if not self._mixed or not 0 < chunks <= MIXED_CHUNKS:
            return None
        p = sum(len(it.token_ids) for it in work[d:])
        return min((k for k in self._mixed if k[0] >= d and k[1] >= p), default=None)

    def _mixed_meta(self, key: tuple[int, int]) -> tuple[list[torch.Tensor], AttnMeta]:
        """A mixed graph's inputs (device views of its staging) and attention metadata: decode rows [0, D) are
        sequences [0, D); chunk j's rows start at D, its sequence is D + j; tiles past the step's have no rows."""
        d, p = key
        tok, pos, slot, ctx, table, tiles, head = _sections(self._mstage.dev, self._mixed_inputs())
        seqs = d + MIXED_CHUNKS
        table = table.view(-1, self.table_width)[:seqs]
        meta = AttnMeta([], [], table, ctx[:seqs], decode_only=False)
        meta.cache["mixed"] = (d, tiles.view(-1, 4)[:p // PREFILL_ROWS + MIXED_CHUNKS])
        return [tok[:d + p], pos[:d + p], slot[:d + p], head[:seqs]], meta

    def _capture_mixed(self) -> None:
        """Capture every mixed graph not captured yet (CUDA graphs on, a step budget given). Each writes its logits
        into one buffer they share (`_mixed_out`): a graph's own output would hold ~100 MB of logits apiece."""
        if not self.use_graphs or not self.mixed_keys:
            return
        if getattr(self, "_mstage", None) is None:
            self._mstage = _Staging(self.device, _span(self._mixed_inputs()))
            rows = max(k[0] for k in self.mixed_keys) + MIXED_CHUNKS
            self._mixed_out = torch.empty(rows, self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        self._mixed_blank()
        self._mstage.upload(self._mstage.host.numel())
        for key in sorted(set(self.mixed_keys) - set(self._mixed), reverse=True):
            (tok, pos, slot, head), meta = self._mixed_meta(key)
            self._split = key[0]
            try:
                self._forward(tok, pos, slot, meta, head)  # compiles, tunes, allocates outside the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._gpool):
                    logits = self._forward(tok, pos, slot, meta, head)
                    self._mixed_out[:logits.shape[0]].copy_(logits)
                graph.replay()  # uploaded now, not at its first step (`_warm_launch`): over padding, nothing written
            finally:
                self._split = None
            self._gpool = graph.pool()
            self._mixed[key] = graph

    def _mixed_blank(self) -> None:
        """Every mixed input padding (host): no row writes KV, no sequence has context, no tile has rows."""
        tok, pos, slot, ctx, table, tiles, head = _sections(self._mstage.host, self._mixed_inputs())
        for view in (tok, pos, ctx, table, tiles, head):
            view.zero_()
        slot.fill_(-1)

    def _replay_mixed(self, work: Sequence[RunItem], d: int, key: tuple[int, int],
                      prev: torch.Tensor | None) -> tuple[torch.Tensor, list[int | None]]:
        """One mixed step through its graph: `work`'s first `d` items one token each, the rest prefill chunks;
        the logits rows (D + MIXED_CHUNKS of them) and each item's row among them (None: it does not sample)."""
        D, P = key
        chunks = work[d:]
        self._mstage.ready()
        self._mixed_blank()
        tok, pos, slot, ctx, table, tiles, head = _sections(self._mstage.host, self._mixed_inputs())
        tokens, positions, slots = self._host_rows(work)
        n = len(tokens) - d  # chunk rows
        for view, values in ((tok, tokens), (pos, positions), (slot, slots)):
            view[:d].copy_(torch.tensor(values[:d], dtype=torch.int64))
            view[D:D + n].copy_(torch.tensor(values[d:], dtype=torch.int64))
        starts = [D, *(D + o for o in itertools.accumulate(len(it.token_ids) for it in chunks))]
        seq_rows = list(range(d)) + [D + j for j in range(len(chunks))]
        ctx[torch.tensor(seq_rows, dtype=torch.int64)] = torch.tensor([it.end for it in work], dtype=torch.int64)
        self._fill_tables(table.view(-1, self.table_width), work, seq_rows)
        flat = prefill_tiles([0] * D + starts, [0] * D + [it.end for it in chunks], list(range(D, D + len(chunks))))
        tiles[:len(flat)].copy_(torch.tensor(flat, dtype=torch.int64))
        head[:D].copy_(torch.arange(D))
        head[D:D + len(chunks)].copy_(torch.tensor(starts[1:], dtype=torch.int64) - 1)
        self._mstage.upload(self._mstage.host.numel())
        first_rows = list(range(d)) + starts[:-1]
        self._feed(work, first_rows, self._mstage.dev[:D + P], prev)
        self._mixed[key].replay()
        rows = [r if it.sample else None for r, it in zip(seq_rows, work, strict=True)]
        return self._mixed_out[:D + MIXED_CHUNKS], rows


def _sample_rows(items: Sequence[RunItem]) -> list[int | None]:
    """Each item's row among the sampling items' (None: it does not sample)."""
    k = itertools.count()
    return [next(k) if it.sample else None for it in items]


def _silu_mul(x: torch.Tensor, f: int) -> torch.Tensor:
    return F.silu(x[:, :f]) * x[:, f:]


def check_fused(cfg: ModelConfig, weights: dict[str, torch.Tensor], fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused projections a layer may use: `fused[name]` must be a view of exactly its parts' memory, in order
    (memory.py lays the parts out back to back and views them as one; nothing is copied). A layer without a
    complete, exact set runs its parts one by one."""
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        for name, parts in FUSED.items():
            t = fused.get(p + name)
            if t is None:
                continue
            ws = [weights[p + n] for n in parts]
            ptr, ok = t.data_ptr(), t.is_contiguous() and t.dtype == ws[0].dtype and t.device == ws[0].device
            for w in ws:
                ok = ok and w.is_contiguous() and w.data_ptr() == ptr and w.dtype == t.dtype
                ptr += w.numel() * w.element_size()
            if not ok or tuple(t.shape) != (sum(w.shape[0] for w in ws), ws[0].shape[1]):
                raise ValueError(f"fused {p + name} is not a view of {', '.join(parts)} back to back")
            out[p + name] = t
    return out
