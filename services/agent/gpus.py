"""Which of a spec's GPUs an engine starts on. Pure: decided from the node's GPUs, their health and the records.

Invariants (README "Several GPUs"):
1. A spec names GPUs by UUID or index; each is resolved against the node's GPUs (`libs.common.gpu.resolve_gpu`),
   and a GPU the node does not have is a typed `not_found`, never a silent GPU 0.
2. A successor taking over an engine's memory starts on that engine's GPU (the memory cannot move).
3. Otherwise no engine starts on an unhealthy GPU; active replicas go where the spec has the fewest actives (so
   `replicas` = number of GPUs puts one on each), and standbys where the spec's actives have the fewest standbys
   (a standby shadows an engine of its own GPU: supervision.shadow_plan); ties go to the GPU with fewer
   engines, then to the spec's order.
4. A tensor-parallel spec's GPUs are its groups' bases: a group runs on base..base+tp-1 (rank r on base + r), so a
   base is a candidate only when each of those GPUs is on the node and healthy, and the engines counted on a base
   are those on any of its GPUs. A spec that names its ranks' GPUs (`rank_gpus`: a degraded group on the GPUs a
   failed one left) runs there or nowhere (`rank_gpus_of`).
5. A spare (EngineSpec.spares) starts on a healthy GPU of its spec where no live active engine of the spec runs (it
   stands by for that GPU's fault), the one with the fewest spares of the spec first; none such: a typed `conflict`
   (it waits for a GPU, never shares one with the engine it stands by for).
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


def rank_gpus_of(spec: EngineSpec, gpus: Sequence[GpuEntry]) -> list[int]:
    """The node-local indexes of the GPUs a spec names for its ranks (`rank_gpus`; empty when it names none)."""
    return [resolve_gpu(sel, gpus).index for sel in spec.rank_gpus]


def pick_gpu(spec: EngineSpec, key: str, role: EngineRole, gpus: Sequence[GpuEntry], records: Iterable[EngineRecord],
             unhealthy: Mapping[int, str], *, replacing: EngineRecord | None = None, spare: bool = False) -> GpuEntry:
    if replacing is not None:
        return next((g for g in gpus if g.index == replacing.gpu), GpuEntry(replacing.gpu, ""))
    named = rank_gpus_of(spec, gpus)
    mine = [resolve_gpu(named[0], gpus)] if named else spec_gpus(spec, gpus)
    present = {g.index for g in gpus}
    # a group's GPUs from its base (or the ones it names)
    span = {g.index: named or range(g.index, g.index + spec.tp) for g in mine}
    healthy = [g for g in mine if all(i in present and i not in unhealthy for i in span[g.index])]
    if not healthy:
        why = "; ".join(f"{i}: {unhealthy.get(i, 'not on this node')}" for g in mine for i in span[g.index]
                        if i not in present or i in unhealthy)
        what = "GPU" if spec.tp == 1 else f"group of {spec.tp} GPUs"
        raise Conflict(f"every {what} of {key} is unhealthy ({why})")
    live = [r for r in records if r.live]
    on = {g.index: [r for r in live if set(r.gpus) & set(span[g.index])] for g in healthy}

    def count(g: GpuEntry, r_role: EngineRole) -> int:
        return sum(1 for r in on[g.index] if r.spec_key == key and r.role is r_role and not r.spare)

    order = {g.index: i for i, g in enumerate(healthy)}
    if spare:
        free = [g for g in healthy if not count(g, EngineRole.ACTIVE)]
        if not free:
            raise Conflict(f"every healthy GPU of {key} ({sorted(g.index for g in healthy)}) runs an active engine of it: "
                           "a spare needs one of its own")
        return min(free, key=lambda g: (sum(1 for r in on[g.index] if r.spec_key == key and r.spare),
                                        len(on[g.index]), order[g.index]))
    if role is EngineRole.ACTIVE:
        return min(healthy, key=lambda g: (count(g, EngineRole.ACTIVE), len(on[g.index]), order[g.index]))
    return min(healthy, key=lambda g: (count(g, EngineRole.STANDBY) - count(g, EngineRole.ACTIVE), len(on[g.index]),
                                       order[g.index]))
