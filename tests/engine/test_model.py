"""The reference model, weights file, tokenizer and engine core, in process (tiny size, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.reference.config import SIZES, get_config
from engines.reference.engine import BadRequest, EngineCore, Finished, GenerationRequest, TokenOut
from engines.reference.model import Transformer
from engines.reference.weights import file_metadata, is_drawn, load_weights, make_weights
from libs.common import tokenizer

CFG = get_config("tiny")


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    torch.set_num_threads(1)
    path = make_weights(CFG, tmp_path_factory.mktemp("w") / "tiny.safetensors")
    return EngineCore(Transformer(CFG, load_weights(path)), torch.zeros(CFG.kv_shape(2, 512)))


def run(core: EngineCore, req: GenerationRequest) -> tuple[list[int], Finished]:
    out = list(core.generate(req))
    return [e.token for e in out if isinstance(e, TokenOut)], out[-1]  # type: ignore[return-value]


def test_the_weights_file_is_the_same_bytes_for_the_same_seed_and_differs_for_another(tmp_path: Path) -> None:
    a = make_weights(CFG, tmp_path / "a.safetensors", seed=1).read_bytes()
    b = make_weights(CFG, tmp_path / "b.safetensors", seed=1).read_bytes()
    c = make_weights(CFG, tmp_path / "c.safetensors", seed=2).read_bytes()
    assert a == b and a != c


@pytest.mark.gpu
def test_a_weights_file_drawn_on_the_gpu_is_the_same_bytes_each_time_and_says_where_it_was_drawn(
        tmp_path: Path) -> None:
    cfg = get_config("small@2")
    a = make_weights(cfg, tmp_path / "a.safetensors", seed=1, device="cuda")
    b = make_weights(cfg, tmp_path / "b.safetensors", seed=1, device="cuda")
    assert a.read_bytes() == b.read_bytes()
    assert file_metadata(a)["drawn_on"] == "cuda" and "drawn_on" not in file_metadata(
        make_weights(cfg, tmp_path / "c.safetensors", seed=1))
    w = load_weights(a)
    assert set(w) == set(cfg.tensor_shapes()) and all(torch.isfinite(t.float()).all() for t in w.values())


def test_a_drawn_weights_file_is_its_header_alone_and_loads_the_full_files_values(tmp_path: Path) -> None:
    full = make_weights(CFG, tmp_path / "full.safetensors", seed=5)
    drawn = make_weights(CFG, tmp_path / "drawn.safetensors", seed=5, drawn=True)
    assert drawn.stat().st_size < 64 * 1024 < full.stat().st_size  # no values in it
    assert is_drawn(drawn) and not is_drawn(full) and file_metadata(drawn)["size"] == CFG.name
    a, b = load_weights(full), load_weights(drawn)
    assert set(a) == set(b) == set(CFG.tensor_shapes())
    assert all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)
    other = load_weights(make_weights(CFG, tmp_path / "other.safetensors", seed=6, drawn=True))
    assert not torch.equal(other["output.weight"], b["output.weight"])


def test_a_drawn_weights_file_is_refused_by_tensor_parallel_ranks_with_a_clear_error(tmp_path: Path) -> None:
    from engines.reference.tp import read_shard

    drawn = make_weights(CFG, tmp_path / "drawn.safetensors", drawn=True)
    with pytest.raises(ValueError, match="drawn weights file"):
        read_shard(drawn, CFG, 2, 0)


@pytest.mark.gpu
def test_weights_drawn_into_a_gpu_tensor_equal_a_file_drawn_on_the_gpu(tmp_path: Path) -> None:
    cfg = get_config("small@2")
    full = load_weights(make_weights(cfg, tmp_path / "a.safetensors", seed=2, device="cuda"), "cuda")
    drawn = load_weights(make_weights(cfg, tmp_path / "b.safetensors", seed=2, drawn=True), "cuda")
    assert all(torch.equal(full[n], drawn[n]) for n in full)


def test_sizes_range_from_a_few_megabytes_to_billions_of_parameters() -> None:
    assert 0.5e6 < SIZES["tiny"].n_params() < 2e6
    assert SIZES["8b"].n_params() > 6.5e9
    assert SIZES["8b"].n_kv_heads < SIZES["8b"].n_heads  # grouped-query attention


def test_the_tokenizer_round_trips_text_and_streams_split_characters_whole() -> None:
    ids = tokenizer.encode("héllo ✓")
    assert ids[0] == tokenizer.BOS and tokenizer.decode(ids) == "héllo ✓"
    stream = tokenizer.TextStream()
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) == "héllo ✓" and "" in pieces  # a multi-byte character comes out with its last byte


def test_decoding_with_the_cache_matches_a_full_recomputation(core: EngineCore) -> None:
    ctx = tokenizer.encode("cache check")
    full = core.model.forward(torch.tensor(ctx), 0, torch.zeros(CFG.kv_shape(1, 64))[0])
    kv = torch.zeros(CFG.kv_shape(1, 64))[0]
    step = torch.cat([core.model.forward(torch.tensor([t]), i, kv) for i, t in enumerate(ctx)])
    assert torch.allclose(full, step, atol=1e-4)


def test_a_generation_resumed_from_its_own_tokens_continues_exactly(core: EngineCore) -> None:
    ctx = tokenizer.encode("resume me")
    whole, _ = run(core, GenerationRequest(ctx, 60, ignore_eos=True))
    rest, fin = run(core, GenerationRequest(ctx + whole[:25], 35, ignore_eos=True, prefix_len=len(ctx)))
    assert rest == whole[25:] and fin.completion_tokens == 35


def test_a_chunked_prompt_resumes_exactly_when_the_generated_tokens_are_fed_singly(core: EngineCore) -> None:
    chunked = EngineCore(core.model, torch.zeros(CFG.kv_shape(1, 512)), prefill_chunk=8)
    ctx = tokenizer.encode("a prompt longer than one prefill chunk of eight tokens")
    whole, _ = run(chunked, GenerationRequest(ctx, 40, ignore_eos=True))
    for k in (1, 7, 20):
        rest, _ = run(chunked, GenerationRequest(ctx + whole[:k], 40 - k, ignore_eos=True, prefix_len=len(ctx)))
        assert rest == whole[k:], f"resume after {k} tokens diverged"


def test_prefill_spans_chunk_the_prompt_and_step_the_resumed_tokens() -> None:
    from engines.reference.engine import prefill_spans

    assert prefill_spans(10, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert prefill_spans(7, 5, 4) == [(0, 4), (4, 5), (5, 6), (6, 7)]
    assert prefill_spans(3, None, 64) == [(0, 3)]
    assert prefill_spans(3, 0, 64) == [(0, 1), (1, 2), (2, 3)]


def test_seeded_sampling_is_reproducible_resumable_and_differs_from_greedy(core: EngineCore) -> None:
    ctx = tokenizer.encode("sample me")
    a, _ = run(core, GenerationRequest(ctx, 40, temperature=1.0, seed=5, ignore_eos=True))
    b, _ = run(core, GenerationRequest(ctx, 40, temperature=1.0, seed=5, ignore_eos=True))
    rest, _ = run(core, GenerationRequest(ctx + a[:10], 30, temperature=1.0, seed=5, ignore_eos=True,
                                          prefix_len=len(ctx)))
    greedy, _ = run(core, GenerationRequest(ctx, 40, ignore_eos=True))
    other, _ = run(core, GenerationRequest(ctx, 40, temperature=1.0, seed=6, ignore_eos=True))
    assert a == b and rest == a[10:] and a != greedy and a != other


def test_a_context_longer_than_the_cache_is_refused_and_slots_come_back(core: EngineCore) -> None:
    with pytest.raises(BadRequest):
        core.validate(GenerationRequest([1] * 600, 4))
    it = core.generate(GenerationRequest(tokenizer.encode("abandon"), 50))
    next(it)
    it.close()  # a client that goes away
    assert core.free_slots() == core.slots


def test_a_concurrent_warm_up_leaves_every_slot_free_the_counters_untouched_and_outputs_unchanged(
        core: EngineCore) -> None:
    req = GenerationRequest(context=[5, 6, 7, 8], max_tokens=6, ignore_eos=True)
    before, _ = run(core, req)
    counters = (core.tokens_generated, core.requests_done)
    core.warm_concurrent(core.slots + 1, cuda_only=False)  # more threads than slots: they queue for slots
    assert core.free_slots() == core.slots
    assert (core.tokens_generated, core.requests_done) == counters
    assert run(core, req)[0] == before


def test_the_streamed_weights_file_reads_back_through_safetensors_as_the_seeded_tensors(tmp_path: Path) -> None:
    from engines.reference.weights import _init_tensor

    cfg = get_config("tiny")
    path = make_weights(cfg, tmp_path / "w.safetensors", seed=3, dtype="bfloat16")
    back = load_weights(path)
    assert set(back) == set(cfg.tensor_shapes())
    for name, shape in cfg.tensor_shapes().items():
        assert torch.equal(back[name], _init_tensor(cfg.n_layers, name, shape, 3).to(torch.bfloat16))
    assert file_metadata(path)["size"] == cfg.name


def test_a_traced_generation_reports_its_phases_in_order_and_only_once(core: EngineCore) -> None:
    import time

    phases: dict[str, float] = {}
    core.trace_next(phases, time.perf_counter())
    core.mark("handler")  # the HTTP layer's steps before the generation: the first to pass records it
    first = phases["handler"]
    core.mark("handler")
    assert phases["handler"] == first
    run(core, GenerationRequest(context=[5, 6, 7, 8], max_tokens=2))
    order = [phases[k] for k in ("handler", "called", "slot", "prefill_launched", "first_sampled")]
    assert order == sorted(order) and order[0] >= 0
    assert phases["prefill_tokens"] == 4 and phases["new_segments"] == 0  # no CUDA here: no segments
    again: dict[str, float] = dict(phases)
    run(core, GenerationRequest(context=[5, 6, 7], max_tokens=1))
    assert phases == again  # armed for one generation only
