"""Tensor parallelism for the reference engine (issue 22 part 2): shards, the sharded model, and how rank 0 drives
the other ranks. The processes, memory and gang are tp_runner.py's.

Sharding (Megatron-style, over `tp` ranks):
- column-parallel (rows of the [out, in] matrix split): `wq`, `wk`, `wv` (rank r holds heads r*H/tp.. and kv heads
  r*KV/tp..), `w1`, `w3` (a slice of the feed-forward's hidden units);
- row-parallel (columns split): `wo`, `w2`; each rank's product is a part of the sum, all-reduced (`reduce`), so the
  residual stream is whole and the same on every rank;
- replicated: the norms, the embedding and the output head. Why not vocab-parallel: the byte vocabulary is 258
  tokens (256 KiB of head at 8b), so splitting it saves nothing and would add an all-gather of the logits per
  forward; every rank then computes the whole logits, and only rank 0 samples.
Each rank's KV cache holds its own kv heads only.

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

    @property
    def head_dim(self) -> int:
        return self.dim // (self.n_heads * self.tp)


def shard_config(cfg: ModelConfig, tp: int) -> ShardConfig:
    for what, n in (("heads", cfg.n_heads), ("kv heads", cfg.n_kv_heads), ("ffn_dim", cfg.ffn_dim)):
        if n % tp:
            raise ValueError(f"{cfg.name}: {what} ({n}) do not split over {tp} ranks")
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return ShardConfig(**{**fields, "n_heads": cfg.n_heads // tp, "n_kv_heads": cfg.n_kv_heads // tp,
                          "ffn_dim": cfg.ffn_dim // tp, "tp": tp})


def shard_span(name: str, shape: tuple[int, ...], tp: int, rank: int) -> tuple[int, int, int] | None:
    """(dimension, start, stop) of rank `rank`'s part of tensor `name` (of the whole model's `shape`); None: whole."""
    dim = 0 if name.endswith(COLUMN) else 1 if name.endswith(ROW) else None
    if dim is None:
        return None
    part = shape[dim] // tp
    return dim, rank * part, (rank + 1) * part


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
        for name, shape in cfg.tensor_shapes().items():
            span = shard_span(name, shape, tp, rank)
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
