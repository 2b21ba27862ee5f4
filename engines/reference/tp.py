"""Tensor parallelism for the reference engine (issue 22 part 2): shards, the sharded model, and how rank 0 drives
the other ranks. The processes, memory and gang are tp_runner.py's.

Sharding (Megatron-style, over `tp` ranks):
- column-parallel (rows of the [out, in] matrix split): `wq`, `wk`, `wv` (rank r holds a contiguous span of each
  layer's kv heads, `kv_spans(cfg, tp, layer)[r]`, and the query heads that attend to them), `w1`, `w3` (a span of
  the feed-forward's hidden units, `split(F, tp)[r]`). r*KV/tp.. when tp divides the kv heads. Uneven otherwise, as
  a degraded group of N-1 ranks is (engines/batched/degrade.py): some ranks hold one kv head more in a layer, and
  which ones turns with the layer (FailSafe's cyclic KV placement): rank r holds one more in layer l when
  (r - l) mod tp < KV mod tp. So over any tp consecutive layers every rank holds as many heads, and a rank's KV
  cache and attention weights are the group's 1/tp within one head of a layer, not the first ranks' alone: 8 kv
  heads over 7 ranks, 32 layers, is 36 or 37 heads of layers a rank, where the first rank would hold 64 and the
  others 32 (its cache bounding every rank's block count). The feed-forward's split stays the same in every layer
  (its units differ by one of thousands). A rank's `ShardConfig` says its kv heads by layer;
- row-parallel (columns split): `wo`, `w2`; each rank's product is a part of the sum, all-reduced (`reduce`), so the
  residual stream is whole and the same on every rank;
- replicated: the norms, the embedding and the output head. Why not vocab-parallel: the byte vocabulary is 258
  tokens (256 KiB of head at 8b), so splitting it saves nothing and would add an all-gather of the logits per
  forward; every rank then computes the whole logits, and only rank 0 samples.
Each rank's KV cache holds its own kv heads only (of each layer).

Driving (`TensorParallelCore`): collectives must be issued in the same order on every rank, and rank 0 runs many
requests at once on one forward lock. So rank 0 broadcasts each *forward* (slot, start, tokens) under that lock
before running it, and the other ranks (`follow`) run exactly the forwards rank 0 runs, in its order; a request's
sampling, marks and slots stay on rank 0. Invariants:
1. Every rank runs the same forwards, in the same order, on the same slots and positions; so each rank's KV holds
   its heads of the same positions, and a KV cache handed on (a takeover) is consistent across ranks.
2. Greedy output at tp = N equals tp = 1 (fp32, tiny): the same math, summed in another order
   (tests/engine/test_tp.py).
3. A rank whose peer died fails its next collective: the group stops as one (tp_runner.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engines.reference.config import ModelConfig
from engines.reference.engine import EngineCore
from engines.reference.model import Transformer

log = logging.getLogger("holdfast.engine.tp")

COLUMN = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "feed_forward.w1.weight",
          "feed_forward.w3.weight")
ROW = ("attention.wo.weight", "feed_forward.w2.weight")
FORWARD, STOP = 1, 2


@dataclass(frozen=True)
class ShardConfig(ModelConfig):
    """One rank's share of a model: its heads, kv heads and feed-forward width; the head size stays the model's."""

    tp: int = 1
    model_heads: int = 1  # the whole model's query heads: the head size is dim / model_heads on every rank
    layer_kv_heads: tuple[int, ...] = ()  # this rank's kv heads in each layer (`n_kv_heads`: the most in one)

    @property
    def head_dim(self) -> int:
        return self.dim // self.model_heads

    def kv_heads_at(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.n_kv_heads


def split(n: int, parts: int, turn: int = 0) -> list[tuple[int, int]]:
    """`n` units in `parts` contiguous spans, `n % parts` of them one unit larger (equal when `parts` divides): the
    first ones, or counting from part `turn` round (part r is larger when (r - turn) mod parts < n % parts)."""
    base, extra = divmod(n, parts)
    out, at = [], 0
    for r in range(parts):
        size = base + ((r - turn) % parts < extra)
        out.append((at, at + size))
        at += size
    return out


def kv_spans(cfg: ModelConfig, tp: int, layer: int = 0) -> list[tuple[int, int]]:
    """The kv heads of each rank of a group of `tp` in layer `layer` (each rank's query heads are the ones that
    attend to them): contiguous spans in rank order, the ranks holding one head more turning with the layer (the
    cyclic placement); the same in every layer when tp divides the kv heads."""
    if not 1 <= tp <= cfg.n_kv_heads or cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"{cfg.name}: {cfg.n_kv_heads} kv heads do not split over {tp} ranks")
    return split(cfg.n_kv_heads, tp, turn=layer)


def shard_config(cfg: ModelConfig, tp: int, rank: int = 0) -> ShardConfig:
    """Rank `rank`'s share of `cfg` in a group of `tp` (the same on every rank when tp divides the heads and width)."""
    heads = tuple(k1 - k0 for k0, k1 in (kv_spans(cfg, tp, layer)[rank] for layer in range(cfg.n_layers)))
    f0, f1 = split(cfg.ffn_dim, tp)[rank]
    group, most = cfg.n_heads // cfg.n_kv_heads, max(heads)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return ShardConfig(**{**fields, "n_heads": most * group, "n_kv_heads": most, "ffn_dim": f1 - f0,
                          "tp": tp, "model_heads": cfg.n_heads,
                          "layer_kv_heads": heads if len(set(heads)) > 1 else ()})


def layer_of(name: str) -> int:
    """The layer index of a per-layer tensor's name (`layers.<i>.`...)."""
    return int(name.split(".", 2)[1])


def shard_span(cfg: ModelConfig, name: str, tp: int, rank: int) -> tuple[int, int, int] | None:
    """(dimension, start, stop) of rank `rank`'s part of the whole model's tensor `name`; None: whole."""
    dim = 0 if name.endswith(COLUMN) else 1 if name.endswith(ROW) else None
    if dim is None:
        return None
    if name.endswith(("w1.weight", "w2.weight", "w3.weight")):
        f0, f1 = split(cfg.ffn_dim, tp)[rank]
        return dim, f0, f1
    k0, k1 = kv_spans(cfg, tp, layer_of(name))[rank]
    unit = cfg.head_dim * (1 if name.endswith(("wk.weight", "wv.weight")) else cfg.n_heads // cfg.n_kv_heads)
    return dim, k0 * unit, k1 * unit


def read_shard(path: Path, cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors from the weights file, reading only its part of each split tensor (safetensors maps
    the file; a slice touches only its own bytes)."""
    from safetensors import safe_open

    from engines.reference.weights import is_drawn

    if is_drawn(path):
        raise ValueError(f"{path} is a drawn weights file (its values made at load): it serves single engines, "
                         "not tensor-parallel ranks; make a full file with make-weights without --drawn")
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in cfg.tensor_shapes():
            span = shard_span(cfg, name, tp, rank)
            if span is None:
                out[name] = f.get_tensor(name)
                continue
            dim, start, stop = span
            sl = f.get_slice(name)
            out[name] = (sl[start:stop] if dim == 0 else sl[:, start:stop]).contiguous()
    return out


class ShardedTransformer(Transformer):
    """One rank's model: the row-parallel projections' parts summed over the ranks (all-reduce)."""

    def __init__(self, cfg: ShardConfig, weights: dict[str, torch.Tensor], group: Any = None) -> None:
        super().__init__(cfg, weights)
        self.group = group

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x


class ForwardChannel:
    """Rank 0 -> every rank: which forward to run next. A header [op, slot, start, n], then the n tokens."""

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group

    def send(self, op: int, slot: int = 0, start: int = 0, tokens: list[int] | torch.Tensor | None = None) -> None:
        toks = torch.as_tensor(tokens if tokens is not None else [], dtype=torch.long).to(self.device)
        dist.broadcast(torch.tensor([op, slot, start, toks.numel()], dtype=torch.long, device=self.device), 0,
                       group=self.group)
        if toks.numel():
            dist.broadcast(toks, 0, group=self.group)

    def recv(self) -> tuple[int, int, int, torch.Tensor]:
        head = torch.empty(4, dtype=torch.long, device=self.device)
        dist.broadcast(head, 0, group=self.group)
        op, slot, start, n = (int(v) for v in head.tolist())
        toks = torch.empty(n, dtype=torch.long, device=self.device)
        if n:
            dist.broadcast(toks, 0, group=self.group)
        return op, slot, start, toks


class TensorParallelCore(EngineCore):
    """Rank 0's engine core: each forward is announced to the other ranks before it runs (invariant 1). The lock
    of EngineCore serializes forwards, so the announcements go out in the order the forwards run."""

    def __init__(self, model: ShardedTransformer, kv: torch.Tensor, channel: ForwardChannel, **kw: Any) -> None:
        super().__init__(model, kv, graphs=False, **kw)  # CUDA graphs and collectives: not yet
        self.channel = channel
        self.stopped = False

    def _forward(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        if self.stopped:
            raise RuntimeError("the tensor-parallel group is stopped")
        self.channel.send(FORWARD, slot, start, tokens)
        return super()._forward(slot, tokens, start)

    def stop(self) -> None:
        """Tell every rank to end (after the forward in flight, if any)."""
        with self._lock:
            if not self.stopped:
                self.stopped = True
                self.channel.send(STOP)


def follow(model: ShardedTransformer, kv: torch.Tensor, channel: ForwardChannel) -> int:
    """A rank other than 0: run each forward rank 0 announces, until it says stop; returns how many ran. A dead
    rank 0 makes the broadcast raise (invariant 3)."""
    done = 0
    while True:
        op, slot, start, tokens = channel.recv()
        if op == STOP:
            return done
        if op != FORWARD:
            raise RuntimeError(f"unknown op {op} from rank 0")
        model.forward(tokens, start, kv[slot])
        done += 1
