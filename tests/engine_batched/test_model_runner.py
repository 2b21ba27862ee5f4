"""The batched model runner on the CPU (tiny model, float32) against the reference Transformer, and its
deterministic mode's batch invariance."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from engines.batched.config import parse_config
from engines.batched.model_runner import ModelRunner, RunItem, RunItemError
from engines.reference.config import get_config
from engines.reference.engine import sample
from engines.reference.model import Transformer
from engines.reference.weights import load_weights, make_weights

CFG = get_config("tiny")
BS, BLOCKS = 4, 512


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    return load_weights(make_weights(CFG, path, seed=3))


def new_runner(weights: dict[str, torch.Tensor], **kw: object) -> ModelRunner:
    kv = torch.zeros(CFG.n_layers, 2, BLOCKS, BS, CFG.n_kv_heads, CFG.head_dim)
    return ModelRunner(CFG, weights, kv, BS, **kw)  # type: ignore[arg-type]


def random_tables(rng: random.Random, lengths: list[int]) -> list[list[int]]:
    """Disjoint block tables in random order over the whole cache (block 0 included)."""
    free = list(range(BLOCKS))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // BS))] for n in lengths]


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(CFG.vocab_size) for _ in range(n)]


def test_paged_forward_equals_the_reference_for_prefill_chunks_and_decode(weights) -> None:
    """Six sequences advance together: whole or chunked prefills, then decode rows, every step one batch;
    each sampling row's logits equal the reference Transformer's over the same span."""
    rng = random.Random(0)
    lengths = [rng.randrange(8, 60) for _ in range(6)]
    totals = [n + 6 for n in lengths]  # six decode tokens after each prompt
    seqs = [random_prompt(rng, n) for n in totals]
    tables = random_tables(rng, totals)
    chunks = [rng.choice([1, 5, 16, 64]) for _ in seqs]
    runner, model = new_runner(weights), Transformer(CFG, weights)
    ref_kv = [torch.zeros(CFG.kv_shape(1, 128))[0] for _ in seqs]
    done = [0] * len(seqs)
    while any(d < n for d, n in zip(done, totals, strict=True)):
        items, spans = [], []
        for i, seq in enumerate(seqs):
            if done[i] == totals[i]:
                continue
            step = chunks[i] if done[i] < lengths[i] else 1
            end = min(done[i] + step, lengths[i]) if done[i] < lengths[i] else done[i] + 1
            items.append(RunItem(seq[done[i]:end], done[i], tables[i], sample=True))
            spans.append((i, done[i], end))
            done[i] = end
        got = runner.logits(items)
        for row, (i, start, end) in enumerate(spans):
            want = model.forward(torch.tensor(seqs[i][start:end]), start, ref_kv[i])[-1]
            torch.testing.assert_close(got[row], want, atol=2e-5, rtol=1e-5)


def prefill(runner: ModelRunner, seq: list[int], upto: int, table: list[int]) -> None:
    if upto:
        runner.logits([RunItem(seq[:upto], 0, table, sample=False)])


@pytest.mark.parametrize("tile", [None, 32, 48], ids=["default-tile", "tile-32", "tile-48"])
def test_deterministic_logits_are_bit_identical_alone_and_in_batches_of_1_to_16_others(weights, tile) -> None:
    """Whatever the one-token rows' tile (`deterministic_tile`: one that splits a step's rows, one that holds them
    all), a row's logits are the same alone and among others. (A tile of 5 rows broke it on the CPU: refused.)"""
    rng = random.Random(1)
    runner = new_runner(weights, deterministic=True, deterministic_tile=tile)
    assert runner.tile == (tile or 16) and runner.prefill_tile == 64
    for k in range(1, 17):
        lengths = [rng.randrange(2, 90) for _ in range(k + 1)]
        seqs = [random_prompt(rng, n) for n in lengths]
        tables = random_tables(rng, lengths)
        items = []
        for seq, table in zip(seqs, tables, strict=True):
            start = rng.randrange(len(seq))  # a chunk from here to the end: a decode row when start = n - 1
            prefill(runner, seq, start, table)
            items.append(RunItem(seq[start:], start, table, sample=True))
        target = items[0]
        alone = runner.logits([target])[0]
        rng.shuffle(items)
        batched = runner.logits(items)[items.index(target)]
        assert torch.equal(alone, batched), f"with {k} others: max diff {(alone - batched).abs().max()}"


def test_a_deterministic_tile_not_a_multiple_of_16_is_refused(weights) -> None:
    for tile in (5, 0, 24):
        with pytest.raises(ValueError, match="multiple of 16"):
            new_runner(weights, deterministic=True, deterministic_tile=tile)
    assert parse_config(["--weights", "/w", "--deterministic-tile", "256"]).deterministic_tile == 256
    with pytest.raises(ValidationError, match="multiple of 16"):
        parse_config(["--weights", "/w", "--deterministic-tile", "24"])


def greedy(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill every prompt in one step, then `steps` decode steps of all of them together."""
    out = [[] for _ in prompts]
    toks = runner.run([RunItem(p, 0, t, sample=True) for p, t in zip(prompts, tables, strict=True)])
    for _ in range(steps):
        for o, tok in zip(out, toks, strict=True):
            o.append(tok)
        pos = [len(p) + len(o) - 1 for p, o in zip(prompts, out, strict=True)]
        toks = runner.run([RunItem([o[-1]], s, t, sample=True) for o, s, t in zip(out, pos, tables, strict=True)])
    return out


def test_deterministic_greedy_decode_of_16_batched_equals_each_alone(weights) -> None:
    rng = random.Random(2)
    prompts = [random_prompt(rng, rng.randrange(1, 40)) for _ in range(16)]
    steps = 12
    tables = random_tables(rng, [len(p) + steps for p in prompts])
    batched = greedy(new_runner(weights, deterministic=True), prompts, tables, steps)
    for p, t, want in zip(prompts, tables, batched, strict=True):
        assert greedy(new_runner(weights, deterministic=True), [p], [t], steps) == [want]
    assert len({tuple(s) for s in batched}) > 1  # the sequences differ: the comparison is not trivial


def test_sampling_is_the_reference_engines_seeded_per_seed_and_position(weights) -> None:
    rng = random.Random(3)
    prompts = [random_prompt(rng, rng.randrange(3, 30)) for _ in range(8)]
    tables = random_tables(rng, [len(p) for p in prompts])
    items = [RunItem(p, 0, t, sample=True, temperature=t0, seed=s)
             for p, t, t0, s in zip(prompts, tables, [0.0, 0.7, 1.0, 1.5] * 2, range(8), strict=True)]
    logits = new_runner(weights).logits(items)
    want = [sample(logits[i:i + 1], it.temperature, it.seed, len(it.token_ids)) for i, it in enumerate(items)]
    assert new_runner(weights).run(items) == want
    # the same logits at another position draw differently for some seed: the position is part of the seed
    moved = [sample(logits[i:i + 1], it.temperature, it.seed, len(it.token_ids) + 1) for i, it in enumerate(items)]
    assert moved != want


def test_items_that_do_not_sample_get_none_and_their_kv_is_still_written(weights) -> None:
    rng = random.Random(4)
    seq = random_prompt(rng, 20)
    [table] = random_tables(rng, [20])
    runner = new_runner(weights)
    assert runner.run([RunItem(seq[:10], 0, table, sample=False)]) == [None]
    whole = new_runner(weights).logits([RunItem(seq, 0, table, sample=True)])[0]
    torch.testing.assert_close(runner.logits([RunItem(seq[10:], 10, table, sample=True)])[0], whole,
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("item, message", [
    (RunItem([1] * 5, CFG.max_seq - 2, list(range(BLOCKS)), True), "exceeds"),
    (RunItem([1] * 9, 0, [0, 1], True), "need 3 blocks"),
    (RunItem([1] * 4, 0, [BLOCKS], True), "outside"),
    (RunItem([CFG.vocab_size], 0, [0], True), "vocabulary"),
    (RunItem([], 0, [0], True), "at least one token"),
])
def test_bad_items_raise_a_typed_error_before_anything_runs(weights, item: RunItem, message: str) -> None:
    runner = new_runner(weights)
    with pytest.raises(RunItemError, match=message):
        runner.run([RunItem([1], 0, [0], True), item])
    assert torch.count_nonzero(runner.kv) == 0


def test_kv_bytes_and_the_decode_roofline(weights) -> None:
    runner = new_runner(weights)
    per_token = CFG.n_layers * 2 * CFG.n_kv_heads * CFG.head_dim * 4
    assert runner.kv_bytes_per_token == per_token
    weight_bytes = (CFG.n_params() - CFG.vocab_size * CFG.dim) * 4 + 8 * CFG.dim * 4
    assert runner.roofline_step_s(8, 100, 1e9) == pytest.approx((weight_bytes + 8 * 100 * per_token) / 1e9)
