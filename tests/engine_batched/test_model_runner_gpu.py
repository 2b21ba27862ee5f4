"""The model runner on CUDA (tiny model): the paged forward against the reference Transformer, CUDA graphs
against eager steps, and deterministic mode's batch invariance with CUDA's kernels."""

from __future__ import annotations

import random

import pytest
import torch

from engines.batched.model_runner import ModelRunner, RunItem
from engines.reference.model import Transformer
from tests.engine_batched.test_model_runner import BLOCKS, BS, CFG, random_prompt, random_tables

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.cuda() for n, t in weights.items()}


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    from engines.reference.weights import load_weights, make_weights

    return load_weights(make_weights(CFG, tmp_path_factory.mktemp("w") / "tiny.safetensors", seed=3))


def runner(weights: dict[str, torch.Tensor], **kw: object) -> ModelRunner:
    kv = torch.zeros(CFG.n_layers, 2, BLOCKS, BS, CFG.n_kv_heads, CFG.head_dim, device="cuda")
    r = ModelRunner(CFG, weights, kv, BS, max_num_seqs=32, **kw)  # type: ignore[arg-type]
    r.warmup()
    return r


def decode_run(r: ModelRunner, prompts: list[list[int]], tables: list[list[int]], steps: int) -> tuple[list, list]:
    """Prefill (eager), then greedy decode steps (graphs where captured); tokens and each step's logits."""
    toks = r.run([RunItem(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    seqs = [list(p) + [t] for p, t in zip(prompts, toks, strict=True)]
    logits = []
    for _ in range(steps):
        items = [RunItem([s[-1]], len(s) - 1, t, True) for s, t in zip(seqs, tables, strict=True)]
        lg = r.logits(items)
        logits.append(lg)
        for s, tok in zip(seqs, torch.argmax(lg, -1).tolist(), strict=True):
            s.append(tok)
    return seqs, logits


def test_paged_forward_on_cuda_equals_the_reference(gpu_weights) -> None:
    rng = random.Random(0)
    prompts = [random_prompt(rng, rng.randrange(2, 80)) for _ in range(5)]
    tables = random_tables(rng, [len(p) + 8 for p in prompts])
    seqs, _ = decode_run(runner(gpu_weights), prompts, tables, 8)
    model = Transformer(CFG, gpu_weights)
    for seq in seqs:
        kv = torch.zeros(CFG.kv_shape(1, 128), device="cuda")[0]
        ref = model.forward(torch.tensor(seq[:-1], device="cuda"), 0, kv)
        assert torch.argmax(ref, -1).tolist()[-8:] == seq[-8:]


@pytest.mark.parametrize("deterministic", [False, True])
def test_graph_steps_equal_eager_steps(gpu_weights, deterministic: bool) -> None:
    rng = random.Random(1)
    prompts = [random_prompt(rng, rng.randrange(2, 60)) for _ in range(11)]  # bucket 16: 5 padding rows
    tables = random_tables(rng, [len(p) + 10 for p in prompts])
    graphed = runner(gpu_weights, deterministic=deterministic)
    assert graphed._graphs, "no graphs captured"
    eager = runner(gpu_weights, deterministic=deterministic, cuda_graphs=False)
    seqs_g, logits_g = decode_run(graphed, prompts, tables, 10)
    seqs_e, logits_e = decode_run(eager, prompts, tables, 10)
    assert seqs_g == seqs_e
    for a, b in zip(logits_g, logits_e, strict=True):
        if deterministic:  # the same tiles and the same attention kernel: bit for bit
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_capturing_the_graphs_and_their_warm_replays_write_nothing_into_the_kv_cache(gpu_weights) -> None:
    """Each graph is replayed once right after its capture (its upload to the device, off a recovered engine's first
    step): over padding rows, so a cache full of live sequences' KV (a standby capturing over its reservations,
    a successor capturing when idle) is left exactly as it was."""
    kv = torch.randn(CFG.n_layers, 2, BLOCKS, BS, CFG.n_kv_heads, CFG.head_dim, device="cuda")
    before = kv.clone()
    r = ModelRunner(CFG, gpu_weights, kv, BS, max_num_seqs=32, max_step_tokens=512)
    r.warmup()
    torch.cuda.synchronize()
    assert r._graphs and r._mixed, "no graphs captured"
    assert torch.equal(kv, before)


@pytest.mark.parametrize("deterministic", [False, True])
def test_mixed_graph_steps_equal_eager_steps(gpu_weights, deterministic: bool) -> None:
    """Steps of prefill chunks beside decode rows replayed from the mixed graphs give the eager steps' logits
    (bit for bit in deterministic mode), padding rows and sequences writing and reading nothing."""
    graphed = runner(gpu_weights, deterministic=deterministic, max_step_tokens=512)
    eager = runner(gpu_weights, deterministic=deterministic, cuda_graphs=False)
    assert graphed._mixed, "no mixed graphs captured"
    for seed in range(3):
        outs = []
        for r in (graphed, eager):
            rng = random.Random(10 + seed)
            r.kv.zero_()
            items = mixed_items(r, rng, 3 + 6 * seed)
            replays = []
            if r is graphed:
                original = r._replay_mixed
                r._replay_mixed = lambda *a, o=original, seen=replays: (seen.append(a[2]), o(*a))[1]  # type: ignore[method-assign]
            outs.append((r.logits(items), replays))
            r.__dict__.pop("_replay_mixed", None)
        (a, used), (b, _) = outs
        assert used, "the step ran eagerly"
        if deterministic:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("graphs", [False, True])
def test_deterministic_logits_on_cuda_are_bit_identical_alone_and_batched(gpu_weights, graphs: bool) -> None:
    rng = random.Random(2)
    r = runner(gpu_weights, deterministic=True, cuda_graphs=graphs, max_step_tokens=2048)
    for k in (1, 3, 8, 16, 20):  # 21 sequences of up to 90 rows: several 64-row tiles
        items = mixed_items(r, rng, k + 1)
        target = items[0]
        alone = r.logits([target])[0]
        rng.shuffle(items)
        assert torch.equal(alone, r.logits(items)[items.index(target)]), f"with {k} others"


def mixed_items(r: ModelRunner, rng: random.Random, n: int) -> list[RunItem]:
    """`n` sequences of up to 90 tokens, each with a random part already prefilled: chunks and decode rows."""
    lengths = [rng.randrange(2, 90) for _ in range(n)]
    items = []
    for m, t in zip(lengths, random_tables(rng, lengths), strict=True):
        seq, start = random_prompt(rng, m), rng.randrange(m)
        if start:
            r.logits([RunItem(seq[:start], 0, t, False)])
        items.append(RunItem(seq[start:], start, t, True))
    return items
