"""Fused projections over back-to-back weights (fused_layout.py, memory.py, model_runner.check_fused): the
loader's write order, which runs may be viewed as one tensor, and a runner over the fused views computing what
the separate projections compute, batch-invariant in deterministic mode with prefill chunks beside decode."""

from __future__ import annotations

import random

import pytest
import torch

from engines.batched.fused_layout import Placed, fused_runs, write_order
from engines.batched.memory import _fuse_local
from engines.batched.model_runner import ModelRunner, RunItem, check_fused
from engines.reference.config import get_config
from engines.reference.weights import load_weights, make_weights

CFG = get_config("tiny")
BS, BLOCKS = 4, 512


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    return load_weights(make_weights(CFG, tmp_path_factory.mktemp("w") / "tiny.safetensors", seed=5))


def runner(w: dict[str, torch.Tensor], fused: dict[str, torch.Tensor] | None, **kw: object) -> ModelRunner:
    kv = torch.zeros(CFG.n_layers, 2, BLOCKS, BS, CFG.n_kv_heads, CFG.head_dim)
    return ModelRunner(CFG, w, kv, BS, fused=fused, **kw)  # type: ignore[arg-type]


def test_the_loader_writes_each_layers_fused_parts_back_to_back() -> None:
    names = ["layers.0.attention.wk.weight", "layers.0.attention.wo.weight", "layers.0.attention.wq.weight",
             "layers.0.attention.wv.weight", "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
             "layers.0.feed_forward.w3.weight", "norm.weight"]
    assert write_order(names) == [
        "layers.0.attention.wq.weight", "layers.0.attention.wk.weight", "layers.0.attention.wv.weight",
        "layers.0.attention.wo.weight", "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w3.weight",
        "layers.0.feed_forward.w2.weight", "norm.weight"]


def test_only_complete_gapless_runs_in_one_lease_are_fused() -> None:
    a, b = object(), object()

    def placed(lease: object, gap: int = 0) -> list[Placed]:
        return [Placed("layers.0.feed_forward.w1.weight", lease, 0, (8, 4), "float32", 4, True),
                Placed("layers.0.feed_forward.w3.weight", lease, 128 + gap, (8, 4), "float32", 4, True)]

    assert fused_runs(placed(a)) == {"layers.0.feed_forward.w13.weight": (placed(a)[0], (16, 4))}
    assert fused_runs(placed(a, gap=256)) == {}
    assert fused_runs([placed(a)[0], placed(b)[1]]) == {}
    assert fused_runs(placed(a)[:1]) == {}


def test_a_fused_tensor_that_is_a_copy_is_refused(weights) -> None:
    w = dict(weights)
    fused = _fuse_local(w)
    copy = {n: t.clone() for n, t in fused.items()}
    with pytest.raises(ValueError, match="back to back"):
        runner(w, copy)
    assert len(check_fused(CFG, w, fused)) == 2 * CFG.n_layers


def steps(r: ModelRunner, prompts: list[list[int]], n_decode: int) -> list[list[int]]:
    """Greedy: every prompt prefilled in one step, then `n_decode` decode steps of all together."""
    tables = [[i * 16 + j for j in range(16)] for i in range(len(prompts))]
    toks = [list(p) for p in prompts]
    out = r.run([RunItem(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    for s, tok in zip(toks, out, strict=True):
        s.append(tok)  # type: ignore[arg-type]
    for _ in range(n_decode):
        out = r.run([RunItem([s[-1]], len(s) - 1, t, True) for s, t in zip(toks, tables, strict=True)])
        for s, tok in zip(toks, out, strict=True):
            s.append(tok)  # type: ignore[arg-type]
    return [s[len(p):] for s, p in zip(toks, prompts, strict=True)]


def test_fused_projections_compute_what_the_separate_ones_do(weights) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randrange(3, 30))] for _ in range(5)]
    items = [RunItem(p, 0, [i * 16 + j for j in range(16)], True) for i, p in enumerate(prompts)]
    plain = runner(dict(weights), None).logits(items)
    w = dict(weights)
    fused = runner(w, _fuse_local(w)).logits(items)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


def test_deterministic_fused_runner_gives_a_sequence_the_same_tokens_alone_and_beside_chunks(weights) -> None:
    """A decode row's tile and a prefill chunk's tile differ in size; each row's tokens still do not depend on
    what runs beside it."""
    w = dict(weights)
    fused = _fuse_local(w)
    rng = random.Random(2)
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randrange(2, 40))] for _ in range(20)]
    together = steps(runner(w, fused, deterministic=True), prompts, 6)
    for i in (0, 7, 19):
        assert steps(runner(w, fused, deterministic=True), [prompts[i]], 6) == [together[i]]
    r = runner(w, fused, deterministic=True)  # one sequence decoding beside another's prefill chunk
    a = r.run([RunItem(prompts[0], 0, list(range(16)), True)])
    mixed = r.run([RunItem([a[0]], len(prompts[0]), list(range(16)), True),  # type: ignore[list-item]
                   RunItem(prompts[1], 0, list(range(16, 32)), True)])
    assert [a[0], mixed[0]] == together[0][:2]
    assert mixed[1] == together[1][0]
