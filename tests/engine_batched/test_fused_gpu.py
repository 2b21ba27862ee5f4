"""CUDA: the one-kernel RMSNorm and SwiGLU product against torch, and a runner over fused projections
(fused_layout.py): graphs equal eager steps bit for bit in deterministic mode, and a sequence's deterministic
logits are the same alone and batched beside prefill chunks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engines.batched.memory import _fuse_local
from engines.batched.model_runner import ModelRunner
from engines.reference.model import rms_norm
from tests.engine_batched.test_model_runner import BLOCKS, BS, CFG, random_prompt, random_tables
from tests.engine_batched.test_model_runner_gpu import decode_run, mixed_items

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_mul_kernels_match_torch(dtype: torch.dtype) -> None:
    from engines.batched import paged_kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, device="cuda", generator=g).to(dtype)
    w = torch.randn(4096, device="cuda", generator=g).to(dtype)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(paged_kernels.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), **tol)
    gu = torch.randn(37, 2 * 1000, device="cuda", generator=g).to(dtype)
    torch.testing.assert_close(paged_kernels.silu_mul(gu), F.silu(gu[:, :1000]) * gu[:, 1000:], **tol)
    assert torch.equal(paged_kernels.rms_norm(x[:5], w, 1e-5), paged_kernels.rms_norm(x, w, 1e-5)[:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_add_and_norm_kernel_gives_the_add_then_the_norm_kernels_values(dtype: torch.dtype) -> None:
    from engines.batched import paged_kernels

    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(37, 4096, device="cuda", generator=g).to(dtype)
    d = torch.randn(37, 4096, device="cuda", generator=g).to(dtype)
    w = torch.randn(4096, device="cuda", generator=g).to(dtype)
    want_h = h + d
    want = paged_kernels.rms_norm(want_h, w, 1e-5)
    got = paged_kernels.add_rms_norm_(h, d, w, 1e-5)
    assert torch.equal(h, want_h) and torch.equal(got, want)  # h holds the sum now


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_kernel_gives_apply_ropes_values_bit_for_bit_in_place(dtype: torch.dtype) -> None:
    """q and k heads of a fused projection's rows (v's columns after them untouched), at positions up to 4096."""
    from engines.batched import paged_kernels
    from engines.reference.config import get_config
    from engines.reference.model import apply_rope, rope_tables

    g = torch.Generator(device="cuda").manual_seed(1)
    T, H, KV, hd = 37, 8, 2, 128
    qkv = torch.randn(T, (H + 2 * KV) * hd, device="cuda", generator=g).to(dtype)
    pos = torch.randint(0, 4096, (T,), device="cuda", generator=g)
    cos_t, sin_t = rope_tables(get_config("8b"), torch.device("cuda"))  # head_dim 128
    cos, sin = cos_t[pos].to(dtype), sin_t[pos].to(dtype)
    want = apply_rope(qkv[:, :(H + KV) * hd].view(T, H + KV, hd), cos, sin)
    v = qkv[:, (H + KV) * hd:].clone()
    paged_kernels.rope_(qkv, H + KV, hd, cos, sin)
    assert torch.equal(qkv[:, :(H + KV) * hd].view(T, H + KV, hd), want)
    assert torch.equal(qkv[:, (H + KV) * hd:], v)
    assert paged_kernels.rope_fits(128) and paged_kernels.rope_fits(64) and not paged_kernels.rope_fits(96)


@pytest.fixture(scope="module")
def fused_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    from engines.reference.weights import load_weights, make_weights

    w = {n: t.cuda() for n, t in load_weights(make_weights(CFG, tmp_path_factory.mktemp("w") / "t.safetensors", seed=3)).items()}
    return w, _fuse_local(w)


def runner(fw: tuple[dict, dict], **kw: object) -> ModelRunner:
    kv = torch.zeros(CFG.n_layers, 2, BLOCKS, BS, CFG.n_kv_heads, CFG.head_dim, device="cuda")
    r = ModelRunner(CFG, fw[0], kv, BS, max_num_seqs=32, fused=fw[1], **kw)  # type: ignore[arg-type]
    assert r.fused
    r.warmup()
    return r


def test_fused_graph_steps_equal_eager_steps_in_deterministic_mode(fused_weights) -> None:
    rng = random.Random(1)
    prompts = [random_prompt(rng, rng.randrange(2, 60)) for _ in range(11)]
    tables = random_tables(rng, [len(p) + 10 for p in prompts])
    seqs_g, logits_g = decode_run(runner(fused_weights, deterministic=True), prompts, tables, 10)
    seqs_e, logits_e = decode_run(runner(fused_weights, deterministic=True, cuda_graphs=False), prompts, tables, 10)
    assert seqs_g == seqs_e
    assert all(torch.equal(a, b) for a, b in zip(logits_g, logits_e, strict=True))


def test_fused_deterministic_logits_are_bit_identical_alone_and_beside_chunks(fused_weights) -> None:
    rng = random.Random(2)
    r = runner(fused_weights, deterministic=True, cuda_graphs=False)
    for k in (1, 8, 20):
        items = mixed_items(r, rng, k + 1)
        for target in (items[0], next((it for it in items if len(it.token_ids) == 1), items[0])):
            alone = r.logits([target])[0]
            shuffled = items[:]
            rng.shuffle(shuffled)
            assert torch.equal(alone, r.logits(shuffled)[shuffled.index(target)]), f"with {k} others"
