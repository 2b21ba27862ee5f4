"""The default mode's batched prefill (attention.padded_prefill: every chunk of a step in one padded SDPA call)
gives each chunk what the per-sequence reference gives it, and writes no other row. It runs on CUDA in the
engine; the arithmetic is the same on the CPU, where this checks it."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.batched import attention as A


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 20)), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_each_padded_chunk_equals_its_reference_attention(chunks: list[tuple[int, int]], seed: int) -> None:
    torch.manual_seed(seed)
    blocks, bs, kvh, hd, heads = 64, 4, 2, 8, 4
    kv = torch.randn(2, blocks, bs, kvh, hd)
    seqs = [(n, n + before) for n, before in chunks]  # rows, context (the chunk's last position + 1)
    starts = [0]
    for n, _ in seqs:
        starts.append(starts[-1] + n)
    width = max(-(-c // bs) for _, c in seqs)
    tables = torch.randint(0, blocks, (len(seqs), width))
    q = torch.randn(starts[-1] + 2, heads, hd)  # two rows of no sequence at the end: never written
    meta = A.AttnMeta(starts, [c for _, c in seqs], tables, torch.tensor([c for _, c in seqs]), decode_only=False)
    out = torch.zeros(q.shape[0], heads * hd)
    A.padded_prefill(q, kv, meta, list(range(len(seqs))), out)
    for i, (_, ctx) in enumerate(seqs):
        keys, vals = A.gather(kv, tables[i], ctx)
        ref = A.reference_one(q[starts[i]:starts[i + 1]], keys, vals).flatten(1)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], ref, atol=2e-5, rtol=1e-4)
    assert bool((out[starts[-1]:] == 0).all())
