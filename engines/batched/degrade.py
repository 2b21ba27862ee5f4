"""A degraded successor (issue 22 part 6, FailSafe's core): a tensor-parallel group of N ranks lost a rank's GPU
memory and no N GPUs are left for a whole successor group; a group of M < N ranks on the GPUs that are left (one
engine when M = 1) serves every sequence on from the N ranks' KV backups (host leases, which no GPU fault takes:
backup.py). The way back (a regroup, once the GPUs are healthy again): a group of M > N ranks continues the
backups the same way, N = 1 a single engine's (its one backup, `kv_backup`), the heads re-sharded as for fewer.

The gpu_manager hands the broken gang's backups to the successor's rank 0 (`HF_DEGRADE_GANG` + `HF_TRANSFER_TOKEN`
+ `HF_GANG_GENERATION`, every rank asking: a `degraded` gang takeover, gpu_manager gang.py invariant 10) and
reclaims the rest of the gang, so the weights each rank then loads cold for its new shard (the node's host copy,
else the file) find the GPUs' room. A regrouping group's rank 0 takes a single engine's backup alone over
(`HF_TAKEOVER_FROM` + `HF_TRANSFER_TOKEN`: frozen `backups_only`, taken with `cold_weights`; memory.py
`take_backup`), its other ranks ask for nothing. `restore` then fills every rank's new cache: rank 0 gathers each
rank's kv heads of each chunk of blocks from the backups that hold them (old spans and new overlap unevenly: M
rarely divides the heads as N did) and sends them over (the group's communicator, before any forward); rank 0's
backed rows (which vouch for every rank's copy: backup.py) become its journal, so start-up adopts every sequence
and the router's resumes continue them. Its own backups, if it keeps them, are new (the old ones are laid out for
N shards): the writer's first rounds back every adopted row up again; the N old leases are given back, and a group
registers its gang anew under the old gang's id (a regrouped one under its own).

Invariants (tests/engine_batched/test_tp_degraded.py, test_tp_regroup.py):
1. Heads: old rank r of N held kv heads `kv_spans(model, N, layer)[r]` of each layer (engines/reference/tp.py, the
   cyclic placement: which ranks hold one more turns with the layer); new rank j holds `kv_spans(model, M,
   layer)[j]`, each head of each layer copied from the one backup that held it, into the unit of j's cache that
   holds it (cache_units.py); a head no backup holds refuses the restore (nothing half restored).
2. Blocks keep their ids: every new cache has the backups' block count (rank 0 tells the others before they lease
   it), so the journal's block tables hold as they are.
3. Only the blocks rank 0's rows vouch for are copied; positions past a row's durable point are recomputed
   (counted), as after a whole group's restore (backup.py `restore`).
The control plane orders a regroup (services/dc_manager/steps.py `_regroup`, docs/multi_gpu.md).
"""

from __future__ import annotations

import functools
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.batched.backup import backup_kv_shape, rows_into, vouched
from engines.batched.cache_units import CacheUnits, cache_units, kv_shape
from engines.batched.journal import Journal, JournalLayout
from engines.batched.kv_backup import BACKUP_NAME
from engines.reference.config import ModelConfig
from engines.reference.tp import kv_spans, shard_config

log = logging.getLogger("holdfast.engine.batched.degrade")
NAME = re.compile(re.escape(BACKUP_NAME) + r"\.tp(\d+)-r(\d+)")  # a group's rank's (backup_start.py `allocate`)
CHUNK_BLOCKS = 256  # blocks gathered from a backup per copy: the host-side staging stays bounded


@dataclass
class Degraded:
    """A broken gang's backups as this engine took them over: rank -> that rank's backup tensors."""

    ranks: int
    backups: dict[int, dict[str, torch.Tensor]]
    lease_ids: list[str] = field(default_factory=list)
    timings_ms: dict[str, Any] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return int(self.backups[0][BACKUP_NAME].shape[0])


def backup_rank(name: str) -> tuple[int, int]:
    """(N, r) of a group's rank's backup lease name (`kv_backup.tp<N>-r<r>`); a single engine's (`kv_backup`) is
    rank 0 of 1."""
    if name == BACKUP_NAME:
        return 1, 0
    m = NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"lease {name!r} is no tensor-parallel rank's KV backup")
    return int(m.group(1)), int(m.group(2))


def gathered(named: dict[str, dict[str, torch.Tensor]]) -> Degraded:
    """The takeover's leases (lease name -> its tensors) as the backups of one group (a single engine's: a group of
    one)."""
    by_rank: dict[int, dict[str, torch.Tensor]] = {}
    sizes = set()
    for name, tensors in named.items():
        n, r = backup_rank(name)
        sizes.add(n)
        by_rank[r] = tensors
    if len(sizes) != 1 or sorted(by_rank) != list(range(next(iter(sizes)))):
        raise ValueError(f"the backups {sorted(named)} are not one group's every rank")
    return Degraded(sizes.pop(), by_rank)


def adopt(loaded: Any, d: Degraded | None) -> Any:
    """A cold load (weights, a new cache of the backups' block count) as a degraded successor's: on rank 0 with the
    backups it took over."""
    loaded.source, loaded.degraded = "degraded", d
    if d is not None:
        loaded.timings_ms = {**d.timings_ms, **loaded.timings_ms}
    return loaded


class Alone:
    """A single degraded engine: rank 0 of 1, nothing to tell anyone (tp_group.py `RankComm`: a group's ranks)."""

    rank, size = 0, 1

    def share(self, value: Any) -> Any:
        return value

    def send(self, t: torch.Tensor, dst: int) -> None:
        raise RuntimeError("a single engine has no other rank")

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        raise RuntimeError("a single engine has no other rank")


ALONE = Alone()


def layer_heads(rows: torch.Tensor, units: CacheUnits, layer: int) -> torch.Tensor:
    """Layer `layer`'s kv heads of a backup's blocks (`rows`: [blocks, units, 2, block size, heads a unit, dim], the
    block-major copy of a cache laid out as `units` says): [blocks, 2, block size, heads, dim], in head order."""
    part = rows[:, units.first[layer]:units.first[layer] + units.count[layer]]
    b, n, two, bs, g, hd = part.shape
    return part.permute(0, 2, 3, 1, 4, 5).reshape(b, two, bs, n * g, hd)


@dataclass(frozen=True)
class GroupLayout:
    """How a group of ranks holds a model's kv heads: each layer's spans, rank by rank (`kv_spans`), and each rank's
    cache units (cache_units.py)."""

    spans: tuple[tuple[tuple[int, int], ...], ...]  # [layer][rank]
    units: tuple[CacheUnits, ...]  # [rank]


@functools.cache
def group_layout(whole: ModelConfig, ranks: int) -> GroupLayout:
    """Once per (model, group size): a restore asks for it for every chunk of blocks and every new rank."""
    return GroupLayout(tuple(tuple(kv_spans(whole, ranks, layer)) for layer in range(whole.n_layers)),
                       tuple(cache_units(shard_config(whole, ranks, r)) for r in range(ranks)))


def heads_of(rows: dict[int, torch.Tensor], whole: ModelConfig, size: int, rank: int) -> torch.Tensor:
    """Rank `rank` of `size`'s kv heads of some blocks, from the old ranks' backups of those blocks (`rows`: old rank
    -> [blocks, its units, 2, block size, heads a unit, dim]) that hold them, layer by layer (invariant 1), laid out
    as that rank's cache is: [units, 2, blocks, block size, heads a unit, dim] (cache_units.py)."""
    old, new = group_layout(whole, len(rows)), group_layout(whole, size)
    mine = new.units[rank]
    layers = []
    for layer in range(whole.n_layers):
        lo, hi = new.spans[layer][rank]
        parts = []
        for r, (o0, o1) in enumerate(old.spans[layer]):
            a, b = max(lo, o0), min(hi, o1)
            if a < b:
                parts.append(layer_heads(rows[r], old.units[r], layer)[:, :, :, a - o0:b - o0])
        if sum(t.shape[3] for t in parts) != hi - lo:
            raise ValueError(f"layer {layer}'s kv heads {lo}..{hi} are not all in the backups of {len(rows)} ranks")
        x = torch.cat(parts, dim=3)  # [blocks, 2, block size, hi - lo, dim]
        b, two, bs, _, hd = x.shape
        layers.append(x.reshape(b, two, bs, mine.count[layer], mine.heads, hd).permute(3, 1, 0, 2, 4, 5))
    return torch.cat(layers, dim=0)


def restore(d: Degraded | None, kv: torch.Tensor, journal: Journal, layout: JournalLayout, whole: ModelConfig,
            comm: Any = ALONE) -> dict[str, Any]:
    """This rank's cache filled from the N backups (rank 0 holds them: `d`; None elsewhere) and rank 0's backed rows
    written as its journal (invariants 1-3). `kv`: this rank's cache, laid out for its share
    `shard_config(whole, comm.size, comm.rank)` (cache_units.py); `comm`: its group (rank 0 sends each other rank
    its heads of each chunk of blocks), `ALONE` for one engine. Every rank returns the same counts."""
    t0 = time.perf_counter()
    plan: tuple[Any, ...] | None = None
    entries: list[Any] = []
    dropped = 0
    blocks_n, bs = kv.shape[2], kv.shape[3]
    if comm.rank == 0:
        assert d is not None, "rank 0 of a degraded successor holds the backups"
        ok, entries, dropped, blocks = vouched(d.backups[0], layout)
        for r in range(d.ranks):
            src = d.backups[r][BACKUP_NAME]  # [blocks, its units, 2, block size, heads a unit, head dim]
            want = backup_kv_shape(kv_shape(shard_config(whole, d.ranks, r), blocks_n, bs))
            if tuple(src.shape) != want:
                raise ValueError(f"rank {r} of {d.ranks}'s backup {tuple(src.shape)} is not its share's {want} (a "
                                 f"cache of {blocks_n} blocks)")
        plan = (ok, blocks, d.ranks)
    ok, blocks, ranks = comm.share(plan)
    if not ok:
        return {"restored": 0, "from_ranks": ranks, "why": "the backups were written for another layout"}
    want = kv_shape(shard_config(whole, comm.size, comm.rank), blocks_n, bs)
    if tuple(kv.shape) != want:
        raise ValueError(f"rank {comm.rank} of {comm.size}'s cache {tuple(kv.shape)} is not its share's {want}")
    copied = 0
    for at in range(0, len(blocks), CHUNK_BLOCKS):
        idx = torch.tensor(blocks[at:at + CHUNK_BLOCKS], dtype=torch.long)
        if comm.rank == 0:
            assert d is not None
            rows = {r: d.backups[r][BACKUP_NAME][idx] for r in range(d.ranks)}
            for j in range(comm.size - 1, -1, -1):  # the others' first: rank 0's own copy last
                part = heads_of(rows, whole, comm.size, j)
                if j:
                    comm.send(part.contiguous(), j)
                else:
                    kv[:, :, idx.to(kv.device), :, :] = part.to(kv.device)
                copied += part.numel() * part.element_size()
        else:
            shape = (kv.shape[0], kv.shape[1], len(idx), kv.shape[3], kv.shape[4], kv.shape[5])
            kv[:, :, idx.to(kv.device), :, :] = comm.recv(shape, kv.dtype, 0).to(kv.device)
    restored = 0
    if comm.rank == 0:
        rows_into(journal, entries)
        restored = len(entries)
    if kv.device.type == "cuda":
        torch.cuda.synchronize(kv.device)
    restored, dropped, recomputed = comm.share((restored, dropped, sum(len(e.tokens) - 1 - e.computed
                                                                       for e in entries)))
    return {"restored": restored, "dropped": dropped, "from_ranks": ranks, "to_ranks": comm.size,
            "blocks": len(blocks), "bytes": copied, "recomputed_tokens": recomputed,
            "ms": round((time.perf_counter() - t0) * 1000, 3)}


def restore_loaded(loaded: Any, whole: ModelConfig, memory: Any, comm: Any = ALONE) -> dict[str, Any]:
    """`restore` at start-up, on every rank of a degraded successor at the same point: this rank's new cache filled
    (its journal adopted as a handed-on cache's when anything was restored), then the old backups given back (rank 0
    holds them)."""
    info = restore(loaded.degraded, loaded.kv, Journal(loaded.layout, loaded.journal), loaded.layout, whole, comm)
    loaded.kv_handed_on = info["restored"] > 0  # alike on every rank: the ranks' caches agree (tp_group commit)
    if not loaded.kv_handed_on and comm.rank == 0:
        log.warning("degraded start: no sequence restored from the backups (%s)", info.get("why", "none backed up"))
    if loaded.degraded is not None:
        memory.release(loaded.degraded.lease_ids)
    return info


def describe(info: dict[str, Any]) -> str:
    """One line for the incident's timeline (a regroup, more ranks than the backups', says so)."""
    def ranks(n: int) -> str:
        return "one engine" if n == 1 else f"{n} ranks"

    to, since = info.get("to_ranks", 1), info.get("from_ranks", 1)
    how = "regrouped" if to > since else "degraded" if to < since else "a whole group again"
    if not info.get("restored"):
        return f"{how} ({ranks(to)}): no sequence restored ({info.get('why', 'none backed up')})"
    frm = f"from {ranks(since)} to {ranks(to)}" if to != since else f"on {ranks(to)}"
    return (f"{how} {frm}: KV of {info['restored']} sequences from their host backups, "
            f"{info['blocks']} blocks in {info['ms']:.1f} ms, {info['recomputed_tokens']} positions recomputed")
