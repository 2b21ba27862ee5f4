"""The paged KV cache's units (pure, engines/batched/cache_units.py) and a group's cache size: every rank of an
uneven group makes as many blocks from the same GiB (the ranks' commit refuses caches that disagree)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.batched.cache_units import cache_units, kv_shape
from engines.batched.config import EngineConfig
from engines.batched.memory import layout_fn
from engines.reference.config import get_config
from engines.reference.tp import shard_config


def test_a_whole_models_cache_is_one_unit_a_layer_and_an_uneven_ranks_one_head_a_unit() -> None:
    whole = get_config("tiny3")  # 2 layers, 3 kv heads
    u = cache_units(whole)
    assert (u.heads, u.first, u.count) == (3, (0, 1), (1, 1))
    assert kv_shape(whole, 7, 16) == (2, 2, 7, 16, 3, whole.head_dim)
    r0 = cache_units(shard_config(whole, 2, 0))  # 2 heads in layer 0, 1 in layer 1
    assert (r0.heads, r0.first, r0.count, list(r0.of(1))) == (1, (0, 2), (2, 1), [2])
    small = shard_config(get_config("small"), 2, 1)  # 4 kv heads over 2: 2 a layer, one unit each
    assert (cache_units(small).heads, cache_units(small).total) == (2, 8)


@pytest.mark.parametrize(("size", "tp"), [("small", 3), ("8b", 7), ("tiny3", 2), ("tiny", 2)])
def test_every_rank_of_a_group_makes_as_many_blocks_from_the_same_gib(size: str, tp: int) -> None:
    """`--kv-cache-gib` on a group: counted in the largest rank's blocks. small's 4 kv heads over 3 ranks hold 11,
    11 and 10 heads of its 8 layers: each rank counting its own blocks made 10 ranks' worth of caches disagree."""
    cfg = EngineConfig(weights=Path("w.safetensors"), size=size, tp=tp, kv_cache_gib=0.01)
    whole = get_config(size)
    got = set()
    for r in range(tp):
        mcfg = shard_config(whole, tp, r)
        layout = layout_fn(cfg.model_copy(update={"tp_rank": r}), mcfg, torch.device("cpu"))(torch.float32, None)
        got.add(layout.num_blocks)
        per_block = torch.Size(kv_shape(mcfg, 1, cfg.block_size)).numel() * 4
        assert layout.num_blocks * per_block <= 0.01 * 2**30
    assert len(got) == 1
    if tp > 1 and whole.n_kv_heads % tp:
        widest = max(torch.Size(kv_shape(shard_config(whole, tp, r), 1, cfg.block_size)).numel() for r in range(tp))
        assert got == {int(0.01 * 2**30) // (widest * 4)}
