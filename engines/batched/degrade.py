"""A degraded successor (issue 22 part 6, FailSafe's core): a tensor-parallel group of N ranks lost a rank's GPU
memory and no N GPUs are left for a whole successor group; this engine, on the GPU that is left, serves every
sequence on from the N ranks' KV backups (host leases, which no GPU fault takes: backup.py).

The gpu_manager hands the broken gang's backups to this engine (`HF_DEGRADE_GANG` + `HF_TRANSFER_TOKEN` +
`HF_GANG_GENERATION`: a `degraded` gang takeover, gpu_manager gang.py invariant 10) and reclaims the rest of the
gang, so the weights this engine then loads cold (the node's host copy, else the file: its shard is the whole
model, no rank's) find the GPU's room. `restore` then fills this engine's new cache from all N backups and writes
rank 0's backed rows (which vouch for every rank's copy: backup.py) as its journal; start-up adopts them as a
handed-on cache's, and the router's resumes continue every stream. Its own backup, if it keeps one, is new (the
old ones are laid out for N shards): the writer's first rounds back every adopted row up again, then the N old
leases are given back.

Invariants (tests/engine_batched/test_tp_degraded.py):
1. Heads: old rank r of N held kv heads [r*KV/N, (r+1)*KV/N) (engines/reference/tp.py); each backup lands at that
   span of this engine's cache, and a cache with no backup for some span is refused (nothing half restored).
2. Blocks keep their ids: the new cache has the backups' block count (memory.py `degraded_takeover`), so the
   journal's block tables hold as they are.
3. Only the blocks rank 0's rows vouch for are copied; positions past a row's durable point are recomputed
   (counted), as after a whole group's restore (backup.py `restore`).
Not built: a degraded group of 1 < M < N ranks (each would need the heads of several old ranks, sharded unevenly
when M does not divide the kv heads); the control plane's choice to degrade (docs/multi_gpu.md).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.batched.backup import rows_into, vouched
from engines.batched.journal import Journal, JournalLayout
from engines.batched.kv_backup import BACKUP_NAME

NAME = re.compile(r"kv_backup\.tp(\d+)-r(\d+)")
CHUNK_BLOCKS = 256  # blocks gathered from a backup per copy: the host-side staging stays bounded


@dataclass
class Degraded:
    """A broken gang's backups as this engine took them over: rank -> that rank's backup tensors."""

    ranks: int
    backups: dict[int, dict[str, torch.Tensor]]
    lease_ids: list[str] = field(default_factory=list)


def backup_rank(name: str) -> tuple[int, int]:
    """(N, r) of a group's rank's backup lease name (`kv_backup.tp<N>-r<r>`)."""
    m = NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"lease {name!r} is no tensor-parallel rank's KV backup")
    return int(m.group(1)), int(m.group(2))


def spans(kv_heads: int, ranks: int) -> list[tuple[int, int]]:
    """The kv heads each rank of a uniform group held (invariant 1)."""
    if kv_heads % ranks:
        raise ValueError(f"{kv_heads} kv heads do not split over {ranks} ranks")
    part = kv_heads // ranks
    return [(r * part, (r + 1) * part) for r in range(ranks)]


def gathered(named: dict[str, dict[str, torch.Tensor]]) -> Degraded:
    """The takeover's leases (lease name -> its tensors, lease id under "id") as the backups of one group."""
    by_rank: dict[int, dict[str, torch.Tensor]] = {}
    sizes = set()
    for name, tensors in named.items():
        n, r = backup_rank(name)
        sizes.add(n)
        by_rank[r] = tensors
    if len(sizes) != 1 or sorted(by_rank) != list(range(next(iter(sizes)))):
        raise ValueError(f"the backups {sorted(named)} are not one group's every rank")
    return Degraded(sizes.pop(), by_rank)


def restore(d: Degraded, kv: torch.Tensor, journal: Journal, layout: JournalLayout) -> dict[str, Any]:
    """Every block rank 0's rows vouch for, each old rank's heads from its own backup, into `kv` (this engine's whole
    cache, [layers, 2, blocks, block size, kv heads, head dim]); rank 0's rows as the journal (invariants 1-3)."""
    t0 = time.perf_counter()
    ok, entries, dropped, blocks = vouched(d.backups[0], layout)
    if not ok:
        return {"restored": 0, "from_ranks": d.ranks, "why": "the backups were written for another layout"}
    heads = spans(kv.shape[4], d.ranks)
    for r, (h0, h1) in enumerate(heads):
        src = d.backups[r][BACKUP_NAME]  # [blocks, layers, 2, block size, its kv heads, head dim]
        if src.shape[0] != kv.shape[2] or tuple(src.shape[4:]) != (h1 - h0, kv.shape[5]):
            raise ValueError(f"rank {r}'s backup {tuple(src.shape)} does not hold kv heads {h0}..{h1} of a cache "
                             f"{tuple(kv.shape)}")
    copied = 0
    for at in range(0, len(blocks), CHUNK_BLOCKS):
        idx = torch.tensor(blocks[at:at + CHUNK_BLOCKS], dtype=torch.long)
        for r, (h0, h1) in enumerate(heads):
            part = d.backups[r][BACKUP_NAME][idx].permute(1, 2, 0, 3, 4, 5)
            kv[:, :, idx.to(kv.device), :, h0:h1] = part.to(kv.device, non_blocking=False)
            copied += part.numel() * part.element_size()
    rows_into(journal, entries)
    if kv.device.type == "cuda":
        torch.cuda.synchronize(kv.device)
    return {"restored": len(entries), "dropped": dropped, "from_ranks": d.ranks, "blocks": len(blocks),
            "bytes": copied, "recomputed_tokens": sum(len(e.tokens) - 1 - e.computed for e in entries),
            "ms": round((time.perf_counter() - t0) * 1000, 3)}


def describe(info: dict[str, Any]) -> str:
    """One line for the incident's timeline."""
    if not info.get("restored"):
        return f"degraded to one engine: no sequence restored ({info.get('why', 'none backed up')})"
    return (f"degraded to one engine from {info['from_ranks']} ranks: KV of {info['restored']} sequences from their "
            f"host backups, {info['blocks']} blocks in {info['ms']:.1f} ms, {info['recomputed_tokens']} positions "
            "recomputed")
