"""Which of a spec's GPUs an engine starts on. Pure: decided from the node's GPUs, their health and the records.

Invariants (README "Several GPUs"):
1. A spec names GPUs by UUID or index; each is resolved against the node's GPUs (`libs.common.gpu.resolve_gpu`),
   and a GPU the node does not have is a typed `not_found`, never a silent GPU 0.
2. A successor taking over an engine's memory starts on that engine's GPU (the memory cannot move).
3. Otherwise no engine starts on an unhealthy GPU; active replicas go where the spec has the fewest actives (so
   `replicas` = number of GPUs puts one on each), and standbys where the spec's actives have the fewest standbys
   (a standby shadows an engine of its own GPU: supervision.shadow_plan); ties go to the GPU with fewer
   engines, then to the spec's order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from libs.common.errors import Conflict
from libs.common.events import EngineRole, EngineSpec
from libs.common.gpu import GpuEntry, resolve_gpu
from services.agent.engines import EngineRecord


def spec_gpus(spec: EngineSpec, gpus: Sequence[GpuEntry]) -> list[GpuEntry]:
    """The spec's GPUs in its order, duplicates dropped (raises NotFound for one this node lacks)."""
    out: list[GpuEntry] = []
    for sel in spec.gpus or [0]:
        entry = resolve_gpu(sel, gpus)
        if entry not in out:
            out.append(entry)
    return out


def pick_gpu(spec: EngineSpec, key: str, role: EngineRole, gpus: Sequence[GpuEntry], records: Iterable[EngineRecord],
             unhealthy: Mapping[int, str], *, replacing: EngineRecord | None = None) -> GpuEntry:
    if replacing is not None:
        return next((g for g in gpus if g.index == replacing.gpu), GpuEntry(replacing.gpu, ""))
    mine = spec_gpus(spec, gpus)
    healthy = [g for g in mine if g.index not in unhealthy]
    if not healthy:
        why = "; ".join(f"{g.index}: {unhealthy[g.index]}" for g in mine)
        raise Conflict(f"every GPU of {key} is unhealthy ({why})")
    live = [r for r in records if r.live]
    on = {g.index: [r for r in live if r.gpu == g.index] for g in healthy}

    def count(g: GpuEntry, r_role: EngineRole) -> int:
        return sum(1 for r in on[g.index] if r.spec_key == key and r.role is r_role)

    order = {g.index: i for i, g in enumerate(healthy)}
    if role is EngineRole.ACTIVE:
        return min(healthy, key=lambda g: (count(g, EngineRole.ACTIVE), len(on[g.index]), order[g.index]))
    return min(healthy, key=lambda g: (count(g, EngineRole.STANDBY) - count(g, EngineRole.ACTIVE), len(on[g.index]),
                                       order[g.index]))
