"""The node's GPUs as the gpu_manager sees them: inventory, health, and what each one's etcd record says. Pure.

Invariants (README "GPUs"):
1. A GPU is named by its node-local index everywhere inside (leases, etcd keys) and may be asked for by UUID.
2. An unhealthy GPU takes no new lease (`GpuUnhealthy`), and none of its leases stays live: the caller reclaims
   them when it marks the GPU (`LeaseBook.gpu_failed`), since the memory of a failed GPU is lost.
3. A record's `leased_bytes` is the sum of its live leases' sizes; the host backend's simulated GPUs split the
   host's capacity evenly, so their free bytes add up to what the host backend can really hand out.
4. A GPU marked unhealthy stays so until marked healthy, across restarts of the manager: the mark is durable (db
   `gpu_health`, by UUID) before its leases are reclaimed and before the reply, and `restore()` reads it back before
   any engine is served.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from libs.client.protocol import GpuUnhealthy  # shared with the SDK, which raises it typed
from libs.common.events import GpuRecord, LeaseInfo, LeaseState
from libs.common.gpu import GpuEntry, resolve_gpu

LIVE = (LeaseState.ACTIVE, LeaseState.ORPHANED, LeaseState.FROZEN)


@dataclass
class GpuBoard:
    node: str
    gpus: Sequence[GpuEntry]
    # index -> why it is unhealthy; absent: healthy. Mirrors the db's `gpu_health` rows (invariant 4).
    unhealthy: dict[int, str] = field(default_factory=dict)
    links: Mapping[int, frozenset[int]] = field(default_factory=dict)  # index -> the GPUs it reaches over NVLink

    def entry(self, selector: int | str) -> GpuEntry:
        return resolve_gpu(selector, self.gpus)

    def check_allocatable(self, index: int) -> GpuEntry:
        """The GPU a new lease may go on, or a typed error: NotFound (not this node's) or GpuUnhealthy."""
        gpu = self.entry(index)
        if gpu.index in self.unhealthy:
            raise GpuUnhealthy(f"GPU {gpu.index} ({gpu.uuid}) is unhealthy: {self.unhealthy[gpu.index]}")
        return gpu

    def room(self, index: int, leases: Iterable[LeaseInfo]) -> int | None:
        """Bytes still free on the GPU (None: capacity unknown)."""
        gpu = self.entry(index)
        if gpu.total_bytes is None:
            return None
        return gpu.total_bytes - sum(i.size for i in leases if i.gpu == gpu.index and i.state in LIVE)

    def mark(self, selector: int | str, healthy: bool, detail: str) -> tuple[GpuEntry, bool]:
        """(the GPU, whether its health changed)."""
        gpu = self.entry(selector)
        was = gpu.index not in self.unhealthy
        if healthy:
            self.unhealthy.pop(gpu.index, None)
        else:
            self.unhealthy[gpu.index] = detail or "unhealthy"
        return gpu, was != healthy

    def restore(self, failed: Mapping[str, str]) -> list[str]:
        """The stored marks (UUID -> why) applied; returns the UUIDs this node no longer has (their rows are kept: the
        GPU may come back, and only a healthy mark clears one)."""
        by_uuid = {g.uuid: g.index for g in self.gpus}
        for uuid, why in failed.items():
            if uuid in by_uuid:
                self.unhealthy[by_uuid[uuid]] = why
        return sorted(u for u in failed if u not in by_uuid)

    def records(self, leases: Iterable[LeaseInfo], now: float) -> dict[int, GpuRecord]:
        used: dict[int, list[int]] = {g.index: [0, 0] for g in self.gpus}
        for info in leases:
            if info.state in LIVE and info.gpu in used:
                used[info.gpu][0] += info.size
                used[info.gpu][1] += 1
        return {g.index: GpuRecord(node=self.node, gpu=g.index, uuid=g.uuid, total_bytes=g.total_bytes,
                                   leased_bytes=used[g.index][0], leases=used[g.index][1],
                                   healthy=g.index not in self.unhealthy, detail=self.unhealthy.get(g.index, ""),
                                   simulated=g.simulated, updated_at=now, links=sorted(self.links.get(g.index, ())))
                for g in self.gpus}


def host_board(node: str, selectors: Sequence[str], capacity: int, links: Sequence[str] = ()) -> GpuBoard:
    """The host backend's simulated GPUs (config `gpus`), each an even share of the host capacity, joined by the
    NVLinks config `gpu_links` says ("0-1")."""
    from libs.common.gpu import parse_links, simulated_gpus

    entries = simulated_gpus(selectors, node)
    share = capacity // len(entries)
    return GpuBoard(node, [GpuEntry(e.index, e.uuid, share, simulated=True) for e in entries],
                    links=parse_links(links, [e.index for e in entries]))


def same_record(a: GpuRecord | None, b: GpuRecord) -> bool:
    """Whether `b` says nothing new over `a` (its time aside): nothing to write."""
    return a is not None and a.model_copy(update={"updated_at": 0.0}) == b.model_copy(update={"updated_at": 0.0})
