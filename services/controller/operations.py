"""Operations started on purpose (manual failover, hot upgrade, forced reclaim, drain that moves engines off).

They work on any controller, leader or not: an on-purpose incident is only *created* here (an etcd
transaction on its deterministic id, so two concurrent requests cannot both win); the leader's deadline
pass picks every record in state `opened` up and drives it like a failure. Reclaim is a node command.
"""

from __future__ import annotations

from libs.common.bus import Bus
from libs.common.errors import Conflict, NotFound
from libs.common.events import (
    EngineRole,
    IncidentReason,
    Reclaim,
    ReclaimReply,
    holds_kv_backup,
    rank_engine_id,
)
from libs.common.store import Store
from services.controller.incident import IncidentRecord, incident_id_for, opened_record
from services.controller.incident_log import incident_key
from services.controller.view import ClusterView


async def start_on_purpose(store: Store, view: ClusterView, engine_id: str, reason: IncidentReason, *,
                           version: str | None = None, successor: str | None = None,
                           move_off: bool = False) -> IncidentRecord:
    engine = view.engines.get(engine_id)
    if engine is None:
        raise NotFound(f"no engine {engine_id}")
    if engine.role is not EngineRole.ACTIVE or engine.state in ("failed", "stopped"):
        raise Conflict(f"engine {engine_id} is {engine.role}/{engine.state}: only a serving engine can be replaced")
    current = view.open_incident_for(engine_id)
    if current is not None:
        raise Conflict(f"engine {engine_id} is already in incident {current.id} ({current.state})")
    hit = view.endpoint_of(engine_id)
    rec = opened_record(
        id=incident_id_for(engine_id, engine.generation, reason), engine_id=engine_id, model=engine.model,
        engine_class=engine.engine_class, generation=engine.generation, node=engine.node, gpu=engine.gpu,
        endpoint=(hit[1] if hit else None) or engine.endpoint, reason=reason, version=version,
        successor_hint=successor, move_off=move_off,
    )
    if not await store.create(incident_key(rec.id), rec):
        raise Conflict(f"engine {engine_id} generation {engine.generation} already had a {reason} incident")
    return rec


def regroup_refusal(view: ClusterView, engine_id: str) -> str | None:
    """Why `engine_id` cannot be regrouped now (None: it can be tried): a regroup replaces a degraded engine (fewer
    ranks than its spec: one engine or a smaller group, what a group that lost a GPU is continued by:
    docs/multi_gpu.md part 6) by a whole group on its node, every sequence continued from its KV backups. It needs
    such an engine, a backup on every rank, and as many healthy GPUs on its node as the spec has ranks; the
    dc_manager places the group (room included) and refuses the rest, but an incident that cannot end well is
    spared here (its engine would be routed out for nothing). Pure: the view as it is."""
    engine = view.engines.get(engine_id)
    if engine is None:
        return None  # start_on_purpose says: no such engine
    raw = view.spec_of(engine.engine_class, engine.model) or {}
    tp = raw.get("tp", 1)
    tp = tp if isinstance(tp, int) else 1
    if engine.tp >= tp:
        return f"{engine_id} runs {engine.tp} ranks and its spec {tp}: not a degraded engine, nothing to regroup"
    backed = [r for r in range(engine.tp)
              if any(holds_kv_backup(lease) for lease in view.leases_of(rank_engine_id(engine_id, r)))]
    if len(backed) != engine.tp:
        return (f"{engine_id} keeps no KV backup (--kv-backup) on {engine.tp - len(backed)} of its {engine.tp} ranks: "
                "its sequences could not be continued")
    healthy = [s.gpu for s in view.gpu_slots({engine.node}) if s.healthy]
    if len(healthy) < tp:
        return f"{len(healthy)} healthy GPUs on {engine.node} ({healthy}): a whole group needs {tp}"
    return None


async def reclaim_lease(bus: Bus, view: ClusterView, lease_id: str, *, wait_s: float = 5.0) -> ReclaimReply:
    lease = view.leases.get(lease_id)
    if lease is None:
        raise NotFound(f"no lease {lease_id}")
    current = view.open_incident_for(lease.owner)
    if current is not None:
        raise Conflict(f"lease {lease_id} belongs to {lease.owner}, in incident {current.id}: reclaiming it would lose it")
    return await bus.request(lease.node, Reclaim(lease_id=lease_id, force=True), ReclaimReply, timeout=wait_s)


async def drain_node(store: Store, view: ClusterView, node: str) -> tuple[list[str], list[str]]:
    """Mark `node` unschedulable (placement skips it), then move every serving engine off it: a manual
    failover per engine that cold-starts its successor on another node (GPU memory cannot leave its node)
    and stops the engine once the successor is routed in. Returns (the engines on the node, the incidents
    started); an engine already in an incident is left to it. Idempotent: a repeated drain starts nothing
    twice (incident ids are per engine generation)."""
    if node not in view.nodes:
        raise NotFound(f"no node {node}")
    await store.put(f"drain/{node}", {"node": node})
    engines = sorted(e.engine_id for e in view.engines.values() if e.node == node)
    started = []
    for engine_id in engines:
        engine = view.engines[engine_id]
        if engine.role is not EngineRole.ACTIVE or engine.state != "ready" or view.open_incident_for(engine_id):
            continue  # a standby is the agent's to replace; a starting or failed one is not serving
        try:
            rec = await start_on_purpose(store, view, engine_id, IncidentReason.MANUAL_FAILOVER, move_off=True)
        except Conflict:
            continue  # raced with another incident (or a repeated drain): that one moves it
        started.append(rec.id)
    return engines, started
