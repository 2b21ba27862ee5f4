"""Tensor parallelism for the batched engine (issue 22 part 2): the sharded model runner and how rank 0 drives the
other ranks, step by step. The processes, memory and gang are tp_group.py's.

Sharding (Megatron-style, over `tp` ranks; the shards and their reading are the reference engine's:
engines/reference/tp.py `shard_config`, `read_shard`):
- column-parallel: `wq`, `wk`, `wv` (rank r holds a span of each layer's kv heads and their query heads, uneven when
  tp does not divide them, which ranks hold one more turning with the layer: engines/reference/tp.py `kv_spans`),
  `w1`, `w3`; the fused
  q|k|v and gate|up views (fused_layout.py) are made over a rank's own parts, laid out back to back in its lease;
- row-parallel: `wo`, `w2`; each rank's product is a part of the sum, all-reduced (`ShardedRunner._reduce`): one
  all-reduce after the attention's output projection and one after the MLP's down projection, per layer;
- replicated: the norms, the embedding and the output head. Why not vocab-parallel: the byte vocabulary is 258
  tokens, so splitting the head saves nothing and would add an all-gather of the logits per step; every rank then
  computes the whole logits and only rank 0 samples (from its own, full logits).
Each rank's paged KV cache holds its own kv heads (cache_units.py), in blocks numbered alike on every rank.

Driving: rank 0 runs the engine as ever (scheduler, journal, sampling, HTTP) over a `ShardedRunner`. Every forward
it runs (`_forward`: eager steps; CUDA graphs are off with tp > 1, not yet captured with collectives) is first
broadcast as a plan (`PlanChannel`): the rows' token ids, positions and KV slots, the sequences' query starts,
context lengths and block tables, the rows that reach the head, the deterministic tile split. The other ranks
(`follow`) run exactly the plans rank 0 sends, in its order. The plan is taken after a fed token (async scheduling:
the previous step's sample, still on the device) was put in place, so a follower needs no sampled token of its own.
Invariants:
1. Every rank runs the same forwards, in the same order, over the same rows, slots and blocks; so each rank's KV
   holds its heads of the same positions, and a KV cache handed on (a group's takeover) is consistent across ranks.
2. Rank 0's journal vouches for every rank's KV: a follower writes a layer's KV before it joins that layer's
   all-reduces, and rank 0's forward ends only after the last layer's all-reduce, so once rank 0's step is over
   (and its journal written after it, journal.py invariant 1) every rank's KV of that step is written.
3. Greedy output at tp = N equals tp = 1 (fp32, tiny): the same math, summed in another order
   (tests/engine_batched/test_tp.py). Deterministic mode stays batch-invariant at tp = 2 (a sum of two parts is
   the same in either order); past 2 ranks the all-reduce's order may depend on the tensor's size.
4. A rank whose peer died fails its next collective; the group lives and dies whole (tp_group.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from engines.batched.attention import AttnMeta
from engines.batched.model_runner import ModelRunner

log = logging.getLogger("holdfast.engine.batched.tp")

FORWARD, STOP = 1, 2
HEADER = 7  # op, rows, sequences, table width, head rows (-1: all), tile split (-1: none), decode_only


class PlanChannel:
    """Rank 0 -> every rank: the next forward's plan. A header of HEADER int64, then one int64 payload:
    tokens | positions | slots (rows each) | query starts (sequences + 1) | context lengths | block tables
    (sequences x width) | head rows."""

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device, self.group = device, group

    def _bcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, 0, group=self.group)

    def send(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, meta: AttnMeta,
             head_rows: torch.Tensor | None, split: int | None) -> None:
        T, B = tokens.shape[0], meta.num_seqs
        table = meta.block_tables[:B]
        W = table.shape[1] if B else 0
        H = -1 if head_rows is None else head_rows.shape[0]
        header = [FORWARD, T, B, W, H, -1 if split is None else split, int(meta.decode_only)]
        self._bcast(torch.tensor(header, dtype=torch.int64, device=self.device))
        lists = torch.tensor([*meta.query_starts, *meta.context_lens], dtype=torch.int64).to(self.device)
        parts = [tokens, positions, slots, lists, table.reshape(-1)]
        if head_rows is not None:
            parts.append(head_rows)
        self._bcast(torch.cat([p.to(torch.int64) for p in parts]))  # stream-ordered on NCCL: no host wait

    def stop(self) -> None:
        self._bcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64, device=self.device))

    def recv(self) -> tuple[Any, ...] | None:
        """The next plan as `_forward`'s arguments plus the split; None: rank 0 said stop."""
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        self._bcast(header)
        op, T, B, W, H, split, decode_only = (int(v) for v in header.tolist())
        if op == STOP:
            return None
        if op != FORWARD:
            raise RuntimeError(f"unknown op {op} from rank 0")
        n = 3 * T + (B + 1) + B + B * W + max(H, 0)
        payload = torch.empty(n, dtype=torch.int64, device=self.device)
        self._bcast(payload)
        tokens, positions, slots = payload[:T], payload[T:2 * T], payload[2 * T:3 * T]
        at = 3 * T
        lists = payload[at:at + 2 * B + 1]
        host = lists.tolist()
        # copies of their own, 16-byte aligned: a Triton kernel compiles a variant per pointer alignment (~1 s)
        ctx = lists[B + 1:].clone()
        at += 2 * B + 1
        table = payload[at:at + B * W].view(B, W).clone()
        head = payload[at + B * W:] if H >= 0 else None
        meta = AttnMeta(host[:B + 1], host[B + 1:], table, ctx, decode_only=bool(decode_only))
        return tokens, positions, slots, meta, head, None if split < 0 else split


class ShardedRunner(ModelRunner):
    """One rank's model runner over its shards (a `shard_config` and `read_shard`'s tensors): the row-parallel
    projections' parts summed over the ranks. Rank 0's (`channel` given) broadcasts each forward's plan first."""

    def __init__(self, *args: Any, channel: PlanChannel | None = None, group: Any = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        if self.use_graphs:
            raise ValueError("CUDA graphs with tensor parallelism are not built: run with cuda_graphs=False")
        self.channel, self.group = channel, group
        self.stopped = False

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, meta: AttnMeta,
                 head_rows: torch.Tensor | None) -> torch.Tensor:
        if self.channel is not None:
            if self.stopped:
                raise RuntimeError("the tensor-parallel group is stopped")
            self.channel.send(tokens, positions, slots, meta, head_rows, self._split)
        return super()._forward(tokens, positions, slots, meta, head_rows)

    def stop_followers(self) -> None:
        """Tell every other rank to end. Only once the step thread is stopped: plans and collectives are issued from
        one thread at a time, in one order."""
        if self.channel is not None and not self.stopped:
            self.stopped = True
            self.channel.stop()


@torch.inference_mode()
def follow(runner: ShardedRunner, channel: PlanChannel) -> int:
    """A rank other than 0: run each forward rank 0 plans, until it says stop; returns how many ran. A dead rank 0
    makes the broadcast raise (invariant 4); the logits are rank 0's to sample, dropped here."""
    done = 0
    while (plan := channel.recv()) is not None:
        tokens, positions, slots, meta, head, split = plan
        runner._split = split
        try:
            runner._forward(tokens, positions, slots, meta, head)
        finally:
            runner._split = None
        done += 1
    return done
