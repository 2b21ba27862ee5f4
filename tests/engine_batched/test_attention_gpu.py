"""The CUDA paths of paged attention (Triton store, decode and prefill kernels) against the reference path, on
Llama-8B's attention shape (32 query heads over 8 kv heads of 128), and their batch invariance."""

from __future__ import annotations

import pytest
import torch

from engines.batched.attention import AttnMeta, attend, write_kv

pytestmark = pytest.mark.gpu

HEADS, KVH, HD, BS, BLOCKS = 32, 8, 128, 16, 4096


def case(spans: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    layer_kv = torch.randn(2, BLOCKS, BS, KVH, HD, device="cuda", generator=g).to(dtype)
    perm = torch.randperm(BLOCKS, device="cuda", generator=g).tolist()
    width = max(-(-c // BS) for c, _ in spans)
    tables = [[perm.pop() for _ in range(-(-c // BS))] for c, _ in spans]
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device="cuda")
    starts = [0]
    for _, n in spans:
        starts.append(starts[-1] + n)
    ctxs = [c for c, _ in spans]
    meta = AttnMeta(starts, ctxs, bt, torch.tensor(ctxs, device="cuda"), decode_only=all(n == 1 for _, n in spans))
    q = torch.randn(starts[-1], HEADS, HD, device="cuda", generator=g).to(dtype)
    return q, layer_kv, meta


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_triton_decode_equals_the_reference_path(dtype: torch.dtype, tol: float) -> None:
    q, layer_kv, meta = case([(1, 1), (15, 1), (16, 1), (17, 1), (300, 1), (2049, 1)], dtype)
    torch.testing.assert_close(attend(q, layer_kv, meta), attend(q, layer_kv, meta, reference=True),
                               atol=tol, rtol=tol)


def test_mixed_chunks_and_decode_rows_equal_the_reference_path() -> None:
    q, layer_kv, meta = case([(64, 64), (40, 1), (700, 100), (5, 1), (33, 7)], torch.bfloat16, seed=1)
    torch.testing.assert_close(attend(q, layer_kv, meta), attend(q, layer_kv, meta, reference=True),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_triton_prefill_equals_the_reference_path(dtype: torch.dtype, tol: float) -> None:
    q, layer_kv, meta = case([(2, 2), (16, 16), (17, 17), (40, 33), (700, 128), (2049, 512), (90, 2)], dtype, seed=5)
    torch.testing.assert_close(attend(q, layer_kv, meta), attend(q, layer_kv, meta, reference=True),
                               atol=tol, rtol=tol)


def test_a_prefill_chunk_is_bit_identical_alone_and_among_other_chunks_and_decode_rows() -> None:
    spans = [(300, 128), (37, 1), (64, 64), (900, 1), (129, 3), (5, 5), (2000, 77)]
    q, layer_kv, meta = case(spans, torch.bfloat16, seed=6)
    batched = attend(q, layer_kv, meta)
    for i in (0, 2, 4, 5, 6):
        lo, hi = meta.query_starts[i], meta.query_starts[i + 1]
        alone = AttnMeta([0, hi - lo], [meta.context_lens[i]], meta.block_tables[i:i + 1],
                         meta.context_lens_t[i:i + 1], decode_only=False)
        assert torch.equal(attend(q[lo:hi], layer_kv, alone), batched[lo:hi])


def test_triton_decode_of_a_sequence_is_bit_identical_alone_and_batched() -> None:
    q, layer_kv, meta = case([(37, 1), (900, 1), (1, 1), (250, 1)] * 8, torch.bfloat16, seed=2)
    batched = attend(q, layer_kv, meta)
    for i in (0, 1, 2, 3, 17):
        alone = AttnMeta([0, 1], [meta.context_lens[i]], meta.block_tables[i:i + 1], meta.context_lens_t[i:i + 1],
                         decode_only=True)
        assert torch.equal(attend(q[i:i + 1], layer_kv, alone), batched[i:i + 1])


def test_a_padding_row_reads_nothing_and_yields_zeros() -> None:
    q, layer_kv, meta = case([(20, 1), (0, 1)], torch.bfloat16, seed=3)
    out = attend(q, layer_kv, meta)
    assert torch.count_nonzero(out[1]) == 0 and torch.isfinite(out).all()


def test_triton_store_equals_the_cpu_write_and_skips_padding() -> None:
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(50, KVH, HD, generator=g), torch.randn(50, KVH, HD, generator=g)
    slots = torch.randperm(BLOCKS * BS, generator=g)[:50]
    slots[::7] = -1
    cpu = torch.zeros(2, BLOCKS, BS, KVH, HD, dtype=torch.bfloat16)
    gpu = cpu.cuda()
    write_kv(cpu, k, v, slots)
    write_kv(gpu, k.cuda(), v.cuda(), slots.cuda())
    assert torch.equal(gpu.cpu(), cpu)
