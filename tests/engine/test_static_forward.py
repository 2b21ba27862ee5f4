"""The fixed-shape forwards behind CUDA graphs (engines/reference/static_forward.py): the eager model's numbers
within float tolerance, exact resume within the path, padding that never reaches a real row; and on a GPU,
graph replays equal to the same forwards run eagerly."""

from __future__ import annotations

import threading

import pytest
import torch

from engines.reference.config import get_config
from engines.reference.engine import EngineCore, Finished, GenerationRequest, TokenOut
from engines.reference.model import Transformer
from engines.reference.weights import load_weights, make_weights
from libs.common import tokenizer

CFG = get_config("tiny")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    torch.set_num_threads(1)
    return Transformer(CFG, load_weights(make_weights(CFG, tmp_path_factory.mktemp("w") / "tiny.safetensors")))


def tokens_of(core: EngineCore, req: GenerationRequest) -> list[int]:
    out = list(core.generate(req))
    assert isinstance(out[-1], Finished)
    return [e.token for e in out if isinstance(e, TokenOut)]


def test_one_token_and_first_chunk_forwards_match_the_eager_model_within_float_tolerance(model: Transformer) -> None:
    ctx = tokenizer.encode("fixed shapes, same model")
    eager_kv = torch.zeros(CFG.kv_shape(1, 256))
    static = EngineCore(model, torch.zeros(CFG.kv_shape(1, 256)), prefill_chunk=16, graphs=True)
    assert static.static is not None
    eager_first = model.forward(torch.tensor(ctx[:10]), 0, eager_kv[0])[-1:]
    assert torch.allclose(static.forward(0, ctx[:10], 0), eager_first, atol=1e-4)
    for pos in range(10, len(ctx)):  # then one token at a time, at growing positions
        eager = model.forward(torch.tensor([ctx[pos]]), pos, eager_kv[0])
        assert torch.allclose(static.forward(0, [ctx[pos]], pos), eager, atol=1e-4), f"position {pos}"


def test_padding_never_reaches_a_real_row_of_a_first_chunk(model: Transformer) -> None:
    ctx = tokenizer.encode("padded to sixteen")
    core = EngineCore(model, torch.zeros(CFG.kv_shape(1, 128)), prefill_chunk=16, graphs=True)
    assert core.static is not None
    short = core.forward(0, ctx[:5], 0)
    rows = core.static.forward(core.static.prompt.new_tensor(ctx[:12] + [0] * 4), core.static.prompt_positions,
                               core.kv[0], span=16)
    assert torch.equal(short, rows[4:5])  # row 4 is the same whatever follows it


def test_generations_resume_exactly_on_the_fixed_shape_path(model: Transformer) -> None:
    core = EngineCore(model, torch.zeros(CFG.kv_shape(2, 512)), prefill_chunk=8, graphs=True)
    for text in ("short", "a prompt longer than one prefill chunk of eight tokens"):
        ctx = tokenizer.encode(text)
        whole = tokens_of(core, GenerationRequest(ctx, 40, ignore_eos=True))
        for k in (1, 9, 25):
            rest = tokens_of(core, GenerationRequest(ctx + whole[:k], 40 - k, ignore_eos=True, prefix_len=len(ctx)))
            assert rest == whole[k:], f"{text!r}: resume after {k} tokens diverged"
        sampled = tokens_of(core, GenerationRequest(ctx, 20, temperature=0.8, seed=3, ignore_eos=True))
        again = tokens_of(core, GenerationRequest(ctx + sampled[:6], 14, temperature=0.8, seed=3, ignore_eos=True,
                                                  prefix_len=len(ctx)))
        assert again == sampled[6:]


def test_a_first_chunk_that_does_not_fit_is_refused(model: Transformer) -> None:
    core = EngineCore(model, torch.zeros(CFG.kv_shape(1, 64)), prefill_chunk=8, graphs=True)
    assert core.static is not None
    with pytest.raises(ValueError, match="first chunk"):
        core.static.first_chunk(0, list(range(3, 12)))


def test_a_capture_warm_up_leaves_a_busy_slot_s_cache_as_it_found_it(model: Transformer) -> None:
    core = EngineCore(model, torch.zeros(CFG.kv_shape(2, 128)), prefill_chunk=16, graphs=True)
    assert core.static is not None
    # slot 1 last ran another request's prompt and token: a warm-up on slot 0 replays those inputs there
    tokens_of(core, GenerationRequest(tokenizer.encode("the other slot's request"), 6, ignore_eos=True))
    live = torch.randn(core.kv[0].shape)
    core.kv[0].copy_(live)
    for kind in ("chunk", "decode"):
        core.static.warm_up(kind, 0)
        assert torch.equal(core.kv[0], live), kind


@pytest.mark.gpu
def test_graph_replays_equal_the_same_forwards_run_eagerly(tmp_path) -> None:  # noqa: ANN001
    cfg = get_config("small@4")
    weights = {n: t.to("cuda") for n, t in load_weights(make_weights(cfg, tmp_path / "s.safetensors")).items()}
    model = Transformer(cfg, weights)
    ctx = tokenizer.encode("graphs replay what eager runs")
    req = GenerationRequest(ctx, 24, ignore_eos=True)
    eager = EngineCore(model, torch.zeros(cfg.kv_shape(2, 256), dtype=model.dtype, device="cuda"), graphs=True)
    graphed = EngineCore(model, torch.zeros(cfg.kv_shape(2, 256), dtype=model.dtype, device="cuda"), graphs=True)
    graphed.warm()
    assert graphed.static is not None and len(graphed.static.graphs) == 4  # decode and chunk, per slot
    assert eager.static is not None and not eager.static.graphs
    assert torch.equal(graphed.forward(1, ctx, 0), eager.forward(1, ctx, 0))
    assert torch.equal(graphed.forward(1, [7], len(ctx)), eager.forward(1, [7], len(ctx)))
    assert tokens_of(graphed, req) == tokens_of(eager, req)
    resumed = tokens_of(graphed, GenerationRequest(ctx + tokens_of(eager, req)[:5], 19, ignore_eos=True,
                                                   prefix_len=len(ctx)))
    assert resumed == tokens_of(eager, req)[5:]


def test_whatever_a_cache_held_before_never_reaches_a_result(model: Transformer) -> None:
    ctx = tokenizer.encode("a cache full of NaN")
    clean = EngineCore(model, torch.zeros(CFG.kv_shape(1, 128)), prefill_chunk=16, graphs=True)
    dirty = EngineCore(model, torch.full(CFG.kv_shape(1, 128), float("nan")), prefill_chunk=16, graphs=True)
    req = GenerationRequest(ctx, 12, ignore_eos=True)
    assert tokens_of(dirty, req) == tokens_of(clean, req)


@pytest.mark.gpu
def test_an_engine_already_serving_records_its_graphs_between_forwards_with_the_same_results(tmp_path) -> None:  # noqa: ANN001
    cfg = get_config("small@4")
    weights = {n: t.to("cuda") for n, t in load_weights(make_weights(cfg, tmp_path / "s.safetensors")).items()}
    model = Transformer(cfg, weights)
    core = EngineCore(model, torch.zeros(cfg.kv_shape(2, 256), dtype=model.dtype, device="cuda"), graphs=True)
    reqs = [GenerationRequest(tokenizer.encode(text), 48, ignore_eos=True)
            for text in ("serving while capturing", "another prompt, in the other slot")]
    before = [tokens_of(core, r) for r in reqs]  # fixed-shape forwards, eagerly
    capture = core.capture_graphs_in_background()
    assert capture is not None
    during: list[list[int]] = [[], []]
    # both slots busy with different requests while each slot's graphs are recorded between their forwards
    threads = [threading.Thread(target=lambda i=i: during[i].extend(tokens_of(core, reqs[i]))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    capture.join(120)
    assert core.static is not None and len(core.static.graphs) == 4
    assert before == during == [tokens_of(core, r) for r in reqs]
