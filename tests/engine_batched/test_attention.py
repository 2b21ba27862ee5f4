"""Paged attention's CPU reference path against attention written out plainly over contiguous keys and values."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.batched import attention as A
from engines.batched.attention import AttnMeta, attend, write_kv

KVH, HD, HEADS, BS, BLOCKS = 2, 16, 4, 4, 64


def plain_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """q [n, H, hd] at the last n of ctx positions; keys/vals [ctx, kvh, hd]; one head, one row at a time."""
    n, ctx = q.shape[0], keys.shape[0]
    out = torch.zeros_like(q)
    for r in range(n):
        visible = ctx - n + r + 1
        for h in range(HEADS):
            g = h // (HEADS // KVH)
            scores = keys[:visible, g] @ q[r, h] / math.sqrt(HD)
            out[r, h] = torch.softmax(scores, 0) @ vals[:visible, g]
    return out


def paged_case(seed: int, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, AttnMeta, list]:
    """Sequences of (context, rows) with random keys/values scattered over random blocks; flat queries."""
    g = torch.Generator().manual_seed(seed)
    layer_kv = torch.randn(2, BLOCKS, BS, KVH, HD, generator=g)  # stale values everywhere: must never be read
    free = torch.randperm(BLOCKS, generator=g).tolist()
    tables, contiguous = [], []
    for ctx, _ in spans:
        nb = -(-ctx // BS)
        table = [free.pop() for _ in range(nb)]
        k, v = torch.randn(ctx, KVH, HD, generator=g), torch.randn(ctx, KVH, HD, generator=g)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(ctx)])
        write_kv(layer_kv, k, v, slots)
        tables.append(table)
        contiguous.append((k, v))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    starts = [0]
    for _, n in spans:
        starts.append(starts[-1] + n)
    ctxs = [c for c, _ in spans]
    meta = AttnMeta(starts, ctxs, bt, torch.tensor(ctxs), decode_only=all(n == 1 for _, n in spans))
    q = torch.randn(starts[-1], HEADS, HD, generator=g)
    return q, layer_kv, meta, contiguous


def test_reference_path_equals_plain_attention_for_chunks_and_decode_rows() -> None:
    spans = [(9, 9), (1, 1), (17, 5), (30, 1), (8, 3), (4, 4)]  # (context, rows): prefill, chunks, decodes
    q, layer_kv, meta, contiguous = paged_case(0, spans)
    out = attend(q, layer_kv, meta)
    for i, (k, v) in enumerate(contiguous):
        lo, hi = meta.query_starts[i], meta.query_starts[i + 1]
        want = plain_attention(q[lo:hi], k, v).flatten(1)
        torch.testing.assert_close(out[lo:hi], want, atol=1e-5, rtol=1e-5)


def test_a_sequences_output_is_bit_identical_alone_and_in_any_batch() -> None:
    q, layer_kv, meta, _ = paged_case(1, [(23, 6), (5, 1), (40, 1), (12, 12), (7, 2)])
    batched = attend(q, layer_kv, meta)
    for i in range(meta.num_seqs):
        lo, hi = meta.query_starts[i], meta.query_starts[i + 1]
        alone = AttnMeta([0, hi - lo], [meta.context_lens[i]], meta.block_tables[i:i + 1],
                         meta.context_lens_t[i:i + 1], decode_only=hi - lo == 1)
        assert torch.equal(attend(q[lo:hi], layer_kv, alone), batched[lo:hi])


def test_write_kv_skips_padding_rows_and_touches_only_named_slots() -> None:
    layer_kv = torch.zeros(2, BLOCKS, BS, KVH, HD)
    k, v = torch.ones(3, KVH, HD), 2 * torch.ones(3, KVH, HD)
    write_kv(layer_kv, k, v, torch.tensor([5, -1, 9]))
    flat = layer_kv.view(2, -1, KVH, HD)
    written = flat.abs().sum(dim=(2, 3)).nonzero()[:, 1].unique().tolist()
    assert written == [5, 9]
    assert torch.equal(flat[0, 9], torch.ones(KVH, HD)) and torch.equal(flat[1, 5], 2 * torch.ones(KVH, HD))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 70), min_size=1, max_size=8), before=st.integers(0, 40))
def test_prefill_tiles_cover_each_chunk_once_one_sequence_a_tile(rows: list[int], before: int) -> None:
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)
    ctx = [n + before for n in rows]
    chunks = [i for i, n in enumerate(rows) if n > 1]
    flat = A.prefill_tiles(starts, ctx, chunks)
    tiles = [tuple(flat[j:j + 4]) for j in range(0, len(flat), 4)]
    covered: dict[int, int] = {}
    for seq, row0, n, pos0 in tiles:
        assert seq in chunks and 1 <= n <= A.PREFILL_ROWS
        assert starts[seq] <= row0 and row0 + n <= starts[seq + 1]  # one sequence a tile
        assert pos0 == ctx[seq] - rows[seq] + (row0 - starts[seq])  # the row's own position
        for r in range(row0, row0 + n):
            covered[r] = covered.get(r, 0) + 1
    assert covered == {r: 1 for i in chunks for r in range(starts[i], starts[i + 1])}
