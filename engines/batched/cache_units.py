"""The paged KV cache's shape (pure): `[units, 2 (k|v), num_blocks, block_size, heads of a unit, head_dim]`.

A unit is a run of one layer's kv heads. A whole model's cache, or a rank's of a group whose size divides the kv
heads, has one unit a layer holding all its kv heads (units = layers: `[n_layers, 2, blocks, block_size, n_kv_heads,
head_dim]`). A rank of an uneven group holds a different number of kv heads by layer (engines/reference/tp.py, the
cyclic placement): its units are `g` heads each, `g` the greatest common divisor of its layers' head counts, a
layer's units consecutive and in layer order, so the cache holds this rank's heads and nothing more. A unit,
`kv[u]`, is what the attention takes as a layer's cache: `[2, blocks, block_size, g, head_dim]`, contiguous.
Invariants:
1. Unit u of layer l holds that layer's kv heads (u - first[l]) * g .. + g of this rank's span, in head order.
2. The block axis is the same in every unit: a block id means the same positions in every layer and head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engines.reference.config import ModelConfig


@dataclass(frozen=True)
class CacheUnits:
    heads: int  # kv heads a unit
    first: tuple[int, ...]  # each layer's first unit
    count: tuple[int, ...]  # each layer's units

    @property
    def total(self) -> int:
        return sum(self.count)

    def of(self, layer: int) -> range:
        return range(self.first[layer], self.first[layer] + self.count[layer])


def cache_units(cfg: ModelConfig) -> CacheUnits:
    per_layer = [cfg.kv_heads_at(i) for i in range(cfg.n_layers)]
    g = math.gcd(*per_layer)
    count = tuple(h // g for h in per_layer)
    first = tuple(sum(count[:i]) for i in range(cfg.n_layers))
    return CacheUnits(g, first, count)


def kv_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    u = cache_units(cfg)
    return (u.total, 2, num_blocks, block_size, u.heads, cfg.head_dim)


def block_elements(cfg: ModelConfig, block_size: int) -> int:
    """Elements of one block over every unit (k and v): the cache's size is this x blocks x the dtype's size."""
    return math.prod(kv_shape(cfg, 1, block_size))
