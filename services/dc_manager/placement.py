"""Placement: where an engine's recovery runs. Pure: decided from the view's GPU slots, no I/O.

1. Memory alive, its node present and its GPU healthy: reattach in place (the memory cannot move).
2. Otherwise (memory lost, GPU unhealthy, node gone): cold start on a healthy GPU with room, preferring
   a node holding a copy of the model's weights (`copies`, closest first: a peer, another engine's live lease of
   the same content copied GPU to GPU (issue 22); its host tier, restored at PCIe speed; an artifact on its disk;
   none: the original file; issue 21), then the same node, then a GPU whose capacity
   its gpu_manager reported (`gpus/<node>/<gpu>`) over one of unknown capacity (its room is a guess), then the
   most free memory, then the fewest engines.
3. No such GPU: nothing (the intent fails; the controller records the incident as failed).

A tensor-parallel group of `tp` ranks runs on `tp` GPUs of one node (rank r on g + r, the agent's and the engines'
layout, or on the GPUs its spec names: `EngineSpec.rank_gpus`): it is reattached in place only while every one of
its GPUs is healthy, and cold-started where `tp` healthy GPUs of one node each have room for a rank
(`needed_bytes`: the largest rank's): `tp` consecutive ones from a base, the node's first `tp` such GPUs that all
reach each other over NVLink (`GpuSlot.links`, NVML's word: a group's all-reduces cross no PCIe), or else its
first `tp` such GPUs in index order (a node of 4 whose GPU 1 failed takes a group of 3 on 0, 2 and 3:
`Placement.rank_gpus`). Candidates are ranked as above, then GPUs all joined by NVLink before others (on a node
that reports no links, none is), consecutive GPUs before the others of the same standing, with the least free of
their GPUs as their room. A degraded group's GPUs (`place_degraded`) are chosen the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from libs.common.cluster_view import GpuSlot
from libs.common.events import LeaseInfo


class Action(StrEnum):
    REATTACH = "reattach"
    COLD_START = "cold_start"
    NONE = "none"


@dataclass(frozen=True)
class Placement:
    action: Action
    node: str | None = None
    gpu: int | None = None
    reason: str = ""
    gpus: tuple[int, ...] = ()  # a group's cold start: its GPUs, rank by rank (`gpu` is the first)

    @property
    def rank_gpus(self) -> list[int]:
        """What a group's spec names (`EngineSpec.rank_gpus`): its GPUs where they are not `gpu`..`gpu + tp - 1`."""
        return [] if consecutive(self.gpus) else list(self.gpus)


def consecutive(gpus: Sequence[int]) -> bool:
    """Whether a group's GPUs (ascending, distinct) are `gpus[0]`..`gpus[0] + tp - 1`, the layout no spec names."""
    return not gpus or gpus[-1] - gpus[0] == len(gpus) - 1


def linked(group: Sequence[GpuSlot]) -> bool:
    """Whether every two of a group's GPUs reach each other over NVLink (one GPU: it does)."""
    return all(b.gpu in a.links for i, a in enumerate(group) for b in group[i + 1:])


MAX_LINKED_SETS = 4096  # sets of a node's GPUs tried for one all joined by NVLink (C(12, 6) = 924)


def pick(fit: Sequence[GpuSlot], k: int) -> list[GpuSlot]:
    """`k` of one node's GPUs `fit` (index order): the first set whose GPUs all reach each other over NVLink, else
    the first `k`."""
    if k > 1 and any(s.links for s in fit):
        for combo in itertools.islice(itertools.combinations(fit, k), MAX_LINKED_SETS):
            if linked(combo):
                return list(combo)
    return list(fit[:k])


COPY_RANK = {"peer": 0, "host": 1, "artifact": 2}  # closer first
FILE_RANK = len(COPY_RANK)  # a node without a copy reads the original file


def node_copies(gpu_records: Mapping[tuple[str, int], Mapping[str, Any]], engine_class: str) -> dict[str, str]:
    """node -> the closest copy of `engine_class`'s weights it holds ("peer", "host" or "artifact"), from the
    copies each gpu_manager publishes in its GPU records (name `<engine class>.<lease name>` -> kind, restore.py)."""
    out: dict[str, str] = {}
    for (node, _), rec in gpu_records.items():
        for name, kind in (rec.get("copies") or {}).items():
            if name.startswith(f"{engine_class}.") and kind in COPY_RANK and \
                    COPY_RANK[kind] < COPY_RANK.get(out.get(node, ""), FILE_RANK):
                out[node] = kind
    return out


def released(slots: Iterable[GpuSlot], freed: Iterable[LeaseInfo]) -> list[GpuSlot]:
    """The slots with `freed` leases' bytes given back: leases just reclaimed that the view still counts (it drops
    one when the gpu_manager's etcd mirror deletes its key, some milliseconds later). Pass only leases the view holds
    now, so none is given back twice."""
    back: dict[tuple[str, int], int] = {}
    for lease in freed:
        back[(lease.node, lease.gpu)] = back.get((lease.node, lease.gpu), 0) + lease.size
    return [replace(s, leased_bytes=max(0, s.leased_bytes - back.get((s.node, s.gpu), 0))) for s in slots]


def place(node: str | None, gpu: int, *, memory_lost: bool, needed_bytes: int, slots: Iterable[GpuSlot],
          alive: frozenset[str] | set[str], allowed: frozenset[str] | None = None,
          copies: Mapping[str, str] | None = None, tp: int = 1) -> Placement:
    slots = list(slots)
    by_gpu = {(s.node, s.gpu): s for s in slots}
    home = [by_gpu.get((node or "", gpu + r)) for r in range(tp)]
    if not memory_lost:
        sick = [s.gpu for s in home if s is not None and not s.healthy]
        if node is None or node not in alive:
            why = f"node {node} is gone"
        elif sick:
            why = f"gpu {', '.join(map(str, sick))} on {node} is unhealthy or drained"
        else:
            return Placement(Action.REATTACH, node, gpu, "memory alive on a healthy gpu" if tp == 1 else
                             f"memory alive on healthy gpus {gpu}..{gpu + tp - 1}")
    else:
        why = "memory lost"

    def fits(s: GpuSlot | None) -> bool:
        return s is not None and s.healthy and (s.free_bytes is None or s.free_bytes >= needed_bytes)

    def usable(n: str) -> bool:
        return n in alive and (allowed is None or n in allowed)

    groups: list[list[GpuSlot]] = []  # each candidate's slots, rank by rank
    for base in slots:
        group = [by_gpu.get((base.node, base.gpu + r)) for r in range(tp)]
        if usable(base.node) and all(fits(s) for s in group):
            groups.append([s for s in group if s is not None])
    if tp > 1:  # each node's first `tp` GPUs with room all joined by NVLink, else (none consecutive) its first `tp`
        windows = {(g[0].node, tuple(s.gpu for s in g)) for g in groups}
        for n in sorted({s.node for s in slots if usable(s.node)}):
            fit = pick(sorted((s for s in slots if s.node == n and fits(s)), key=lambda s: s.gpu), tp)
            if len(fit) == tp and (n, tuple(s.gpu for s in fit)) not in windows and (
                    linked(fit) or all(node_ != n for node_, _ in windows)):
                groups.append(fit)
    if not groups:
        if tp == 1:
            return Placement(Action.NONE, reason=f"{why}; no healthy gpu with {needed_bytes} bytes free")
        return Placement(Action.NONE, reason=f"{why}; no node with {tp} healthy gpus of {needed_bytes} bytes free each")
    copies = copies or {}

    def rank(g: list[GpuSlot]) -> tuple[Any, ...]:
        free = [s.free_bytes for s in g]
        known = [f for f in free if f is not None]
        room = min(known) if len(known) == len(free) else None  # None where one's capacity is unknown
        return (COPY_RANK.get(copies.get(g[0].node, ""), FILE_RANK), g[0].node != node, not linked(g),
                not consecutive([s.gpu for s in g]), room is None, -(room or 0), g[0].engines, g[0].node, g[0].gpu)
    best = min(groups, key=rank)
    first, gpus = best[0], tuple(s.gpu for s in best)
    source = copies.get(first.node or "", "file")
    span = (str(first.gpu) if tp == 1 else f"{first.gpu}..{gpus[-1]}" if consecutive(gpus)
            else ",".join(map(str, gpus)))
    where = f"{first.node}/{span}"
    return Placement(Action.COLD_START, first.node, first.gpu, f"{why}: cold start on {where} (weights from {source})",
                     gpus if tp > 1 else ())


def place_degraded(node: str, tp: int, device_bytes: int, *, slots: Iterable[GpuSlot],
                   alive: frozenset[str] | set[str], allowed: frozenset[str] | None = None) -> tuple[list[int], Placement]:
    """A degraded successor for a group of `tp` ranks that lost its memory (engines/batched/degrade.py): the most
    ranks, fewer than `tp`, each on a healthy GPU of `node` (where the group's KV backups are, in host memory) with
    room for its share of the group's `device_bytes` (weights and caches of every rank), the GPUs in index order and
    not necessarily consecutive (the agent starts rank r on the r-th: `EngineSpec.rank_gpus`), the first such set
    all joined by NVLink where there is one (`pick`). ([], a NONE placement) when not even one GPU has room for it
    all."""
    if node not in alive or (allowed is not None and node not in allowed):
        return [], Placement(Action.NONE, reason=f"node {node}, where its backups are, is gone or not this manager's")
    healthy = sorted((s for s in slots if s.node == node and s.healthy), key=lambda s: s.gpu)
    for ranks in range(tp - 1, 0, -1):
        need = -(-device_bytes // ranks)
        fit = [s.gpu for s in pick([s for s in healthy if s.free_bytes is None or s.free_bytes >= need], ranks)]
        if len(fit) == ranks:
            return fit, Placement(Action.COLD_START, node, fit[0],
                                  f"degraded to {ranks} of {tp} ranks on {node}/{','.join(map(str, fit))}")
    return [], Placement(Action.NONE, reason=f"no healthy gpu on {node} with {device_bytes} bytes free")


def degrade_now(policy: str, whole: Placement) -> bool:
    """Whether a group that lost its memory is continued by fewer ranks rather than a whole group cold
    (`EngineSpec.degrade`): "never" never; "first" always; "no_whole_group" when `whole` (a whole group's
    placement) found no room."""
    return policy == "first" or (policy == "no_whole_group" and whole.action is Action.NONE)
