"""Tensor-parallel shards (pure, engines/reference/tp.py): even where the group's size divides the heads and width
(rank r holds r*KV/tp..), uneven otherwise (the first ranks one unit more), each rank's query heads the ones that
attend to its kv heads; the ranks' shards of every split tensor put together give the whole tensor back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engines.batched.cache_units import block_elements, cache_units, kv_shape
from engines.reference.config import get_config
from engines.reference.tp import kv_spans, read_shard, shard_config, shard_span, split
from engines.reference.weights import make_weights


def test_spans_are_contiguous_cover_everything_and_differ_by_at_most_one() -> None:
    for n in range(1, 12):
        for parts in range(1, n + 1):
            spans = split(n, parts)
            assert spans[0][0] == 0 and spans[-1][1] == n and len(spans) == parts
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            sizes = [b - a for a, b in spans]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert split(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]  # divisible: r*n/parts, as before


def test_a_rank_holds_the_query_heads_of_its_kv_heads_and_its_share_of_the_width() -> None:
    cfg = get_config("tiny3")  # 6 heads, 3 kv heads, ffn 344, 2 layers
    assert kv_spans(cfg, 2) == kv_spans(cfg, 2, 0) == [(0, 2), (2, 3)]
    assert kv_spans(cfg, 2, 1) == [(0, 1), (1, 3)]  # the head more turns with the layer
    r0, r1 = shard_config(cfg, 2, 0), shard_config(cfg, 2, 1)
    assert (r0.layer_kv_heads, r1.layer_kv_heads) == ((2, 1), (1, 2))
    assert [(r0.kv_heads_at(i), r0.heads_at(i)) for i in range(2)] == [(2, 4), (1, 2)]
    assert [(r1.kv_heads_at(i), r1.heads_at(i)) for i in range(2)] == [(1, 2), (2, 4)]
    assert r0.ffn_dim == r1.ffn_dim == 172
    assert r0.head_dim == r1.head_dim == cfg.head_dim == 32
    assert shard_span(cfg, "layers.0.attention.wq.weight", 2, 1) == (0, 4 * 32, 6 * 32)
    assert shard_span(cfg, "layers.0.attention.wk.weight", 2, 1) == (0, 2 * 32, 3 * 32)
    assert shard_span(cfg, "layers.1.attention.wk.weight", 2, 1) == (0, 1 * 32, 3 * 32)
    assert shard_span(cfg, "layers.0.attention.wo.weight", 2, 0) == (1, 0, 4 * 32)
    assert shard_span(cfg, "layers.1.attention.wo.weight", 2, 0) == (1, 0, 2 * 32)
    assert shard_span(cfg, "layers.0.feed_forward.w2.weight", 2, 1) == (1, 172, 344)
    assert shard_span(cfg, "norm.weight", 2, 1) is None
    tiny = get_config("tiny")
    assert shard_config(tiny, 2, 0) == shard_config(tiny, 2, 1)  # even: every rank alike
    with pytest.raises(ValueError, match="do not split over 4"):
        shard_config(cfg, 4)  # a rank with no kv head


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_the_ranks_shards_put_together_are_the_whole_model(tmp_path: Path, tp: int) -> None:
    cfg = get_config("tiny3")
    path = make_weights(cfg, tmp_path / "w.safetensors", seed=3)
    whole = load_file(str(path))
    shards = [read_shard(path, cfg, tp, r) for r in range(tp)]
    for r, shard in enumerate(shards):
        assert {n: tuple(t.shape) for n, t in shard.items()} == shard_config(cfg, tp, r).tensor_shapes()
    for name, full in whole.items():
        span = shard_span(cfg, name, tp, 0)
        joined = full if span is None else torch.cat([s[name] for s in shards], dim=span[0])
        assert torch.equal(joined, full), name


@pytest.mark.parametrize(("size", "tp"), [("8b", 7), ("8b", 3), ("70b", 7), ("70b", 5), ("tiny3", 2), ("8b", 4)])
def test_an_uneven_groups_heads_turn_with_the_layer_so_every_ranks_cache_is_a_fair_share(size: str, tp: int) -> None:
    """FailSafe's cyclic placement: 8 kv heads over 7 ranks hold 2 on one rank a layer, but not the same rank every
    layer; a rank's cache (and its attention weights) is the group's 1/tp within one head of a layer, so the block
    count every rank can afford in the same memory is the group's fair share, not the first rank's half."""
    cfg = get_config(size)
    shares = [shard_config(cfg, tp, r) for r in range(tp)]
    for layer in range(cfg.n_layers):
        spans = kv_spans(cfg, tp, layer)
        assert spans[0][0] == 0 and spans[-1][1] == cfg.n_kv_heads
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert [s.kv_heads_at(layer) for s in shares] == [b - a for a, b in spans]
    held = [sum(s.kv_heads_at(i) for i in range(cfg.n_layers)) for s in shares]
    assert sum(held) == cfg.n_layers * cfg.n_kv_heads and max(held) - min(held) <= 1
    # the cache: units of a layer's heads, every head of the rank and nothing more
    elements = [block_elements(s, 16) for s in shares]
    assert [e // (2 * 16 * cfg.head_dim) for e in elements] == held
    for s in shares:
        u = cache_units(s)
        assert [len(u.of(i)) * u.heads for i in range(cfg.n_layers)] == [s.kv_heads_at(i) for i in range(cfg.n_layers)]
        assert kv_shape(s, 5, 16) == (u.total, 2, 5, 16, u.heads, cfg.head_dim)
    if cfg.n_kv_heads % tp == 0:  # even: one unit a layer, every rank alike, as before
        assert len(set(shares)) == 1 and kv_shape(shares[0], 5, 16) == (cfg.n_layers, 2, 5, 16, cfg.n_kv_heads // tp,
                                                                        cfg.head_dim)
    else:  # the largest rank's cache against the first rank's of a placement that did not turn
        contiguous_first = cfg.n_layers * -(-cfg.n_kv_heads // tp)
        assert max(held) < contiguous_first
