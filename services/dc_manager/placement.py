"""Placement: where an engine's recovery runs. Pure: decided from the view's GPU slots, no I/O.

1. Memory alive, its node present and its GPU healthy: reattach in place (the memory cannot move).
2. Otherwise (memory lost, GPU unhealthy, node gone): cold start on a healthy GPU with room, preferring
   the same node, then a GPU whose capacity its gpu_manager reported (`gpus/<node>/<gpu>`) over one of unknown
   capacity (its room is a guess), then the most free memory, then the fewest engines.
3. No such GPU: nothing (the intent fails; the controller records the incident as failed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from libs.common.cluster_view import GpuSlot


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


def place(node: str | None, gpu: int, *, memory_lost: bool, needed_bytes: int, slots: Iterable[GpuSlot],
          alive: frozenset[str] | set[str], allowed: frozenset[str] | None = None) -> Placement:
    slots = list(slots)
    home = next((s for s in slots if s.node == node and s.gpu == gpu), None)
    if not memory_lost:
        if node is None or node not in alive:
            why = f"node {node} is gone"
        elif home is not None and not home.healthy:
            why = f"gpu {gpu} on {node} is unhealthy or drained"
        else:
            return Placement(Action.REATTACH, node, gpu, "memory alive on a healthy gpu")
    else:
        why = "memory lost"
    room = [s for s in slots if s.healthy and s.node in alive and (allowed is None or s.node in allowed)
            and (s.free_bytes is None or s.free_bytes >= needed_bytes)]
    if not room:
        return Placement(Action.NONE, reason=f"{why}; no healthy gpu with {needed_bytes} bytes free")
    best = min(room, key=lambda s: (s.node != node, s.free_bytes is None, -(s.free_bytes or 0), s.engines, s.node,
                                    s.gpu))
    return Placement(Action.COLD_START, best.node, best.gpu, f"{why}: cold start on {best.node}/{best.gpu}")
