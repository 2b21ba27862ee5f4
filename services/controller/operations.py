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

# An on-purpose incident an operator asked for that ended without replacing the engine (no room elsewhere, no spec,
# a failed spawn) may be asked again, once its cause is mended: each attempt its own id (`<id>-a2`, ...), created by
# a transaction as the first, so two concurrent requests still start one (it answered 409 for the record's 7 days).
# Bounded: a cause nobody mends. The drivers (roll-out, regroup) try once a generation, as before.
OPERATOR_ATTEMPTS = 8


async def start_on_purpose(store: Store, view: ClusterView, engine_id: str, reason: IncidentReason, *,
                           version: str | None = None, successor: str | None = None,
                           move_off: bool = False, attempts: int = 1) -> IncidentRecord:
    """The incident created (`opened`: the leader drives it), or NotFound / Conflict. `attempts`: how many
    incidents of this reason the engine's generation may have had, the earlier ones ended."""
    engine = view.engines.get(engine_id)
    if engine is None:
        raise NotFound(f"no engine {engine_id}")
    if engine.role is not EngineRole.ACTIVE or engine.state in ("failed", "stopped"):
        raise Conflict(f"engine {engine_id} is {engine.role}/{engine.state}: only a serving engine can be replaced")
    current = view.open_incident_for(engine_id)
    if current is not None:
        raise Conflict(f"engine {engine_id} is already in incident {current.id} ({current.state})")
    if view.replaced_generation.get(engine_id, -1) >= engine.generation:  # its record outlived it: a lost node's
        raise Conflict(f"engine {engine_id} generation {engine.generation} was replaced already (an incident resolved "
                       f"with another engine); see GET /v1/incidents?engine={engine_id}")
    if successor is not None:
        check_successor(view, engine_id, successor, version)
    hit = view.endpoint_of(engine_id)
    base = incident_id_for(engine_id, engine.generation, reason)
    for attempt in range(1, attempts + 1):
        rec = opened_record(
            id=base if attempt == 1 else f"{base}-a{attempt}", engine_id=engine_id, model=engine.model,
            engine_class=engine.engine_class, generation=engine.generation, node=engine.node, gpu=engine.gpu,
            endpoint=(hit[1] if hit else None) or engine.endpoint, reason=reason, version=version,
            successor_hint=successor, move_off=move_off,
        )
        if await store.create(incident_key(rec.id), rec):
            return rec
        prior = await store.get_model(incident_key(rec.id), IncidentRecord)
        if prior is None or not prior.terminal:  # another request's, opened meanwhile: that one moves it
            raise Conflict(f"engine {engine_id} generation {engine.generation} is in a {reason} incident ({rec.id})")
    raise Conflict(f"engine {engine_id} generation {engine.generation} already had {attempts} {reason} "
                   f"incident{'s' if attempts > 1 else ''}; see GET /v1/incidents?engine={engine_id}")


def check_successor(view: ClusterView, engine_id: str, successor: str, version: str | None) -> None:
    """A successor named by the operator must be one the engine's agent can assign (services/agent/takeover.py): a
    ready standby of its model (and `version`, for an upgrade) on its node and GPUs, not the engine itself; 404 when
    there is no such engine, 409 when it cannot take over. A misspelt name was accepted (202) and the incident routed
    a healthy engine out and froze its leases before the agent refused the name. Pure: the view as it is."""
    engine, cand = view.engines[engine_id], view.engines.get(successor)
    if cand is None:
        raise NotFound(f"no engine {successor}: a failover's successor must be a ready standby of {engine_id}")
    why = None
    if successor == engine_id:
        why = "an engine cannot succeed itself"
    elif cand.role is not EngineRole.STANDBY or cand.state != "standby":
        why = f"it is {cand.role}/{cand.state}, not a ready standby"
    elif cand.node != engine.node:
        why = f"it runs on {cand.node}, {engine_id} on {engine.node} (GPU memory cannot leave its node)"
    elif cand.model != engine.model or (version is not None and cand.version != version):
        why = f"it serves {cand.model} {cand.version}, not {engine.model} {version or ''}".rstrip()
    elif cand.gpus != engine.gpus:
        why = f"it is on GPUs {cand.gpus}, {engine_id} on {engine.gpus}"
    if why is not None:
        raise Conflict(f"{successor} cannot succeed {engine_id}: {why}")


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


async def drain_node(store: Store, view: ClusterView, node: str) -> tuple[list[str], list[str], dict[str, str]]:
    """Mark `node` unschedulable (placement skips it), then move every serving engine off it: a manual
    failover per engine that cold-starts its successor on another node (GPU memory cannot leave its node)
    and stops the engine once the successor is routed in. Returns (the engines on the node, the incidents
    started, each engine not moved by this call and why); an engine already in an incident is left to it. A
    repeated drain starts nothing twice while an engine's incident is open, and moves again an engine whose
    earlier one ended without moving it (`OPERATOR_ATTEMPTS`). A node whose agent's key is gone (the node lost) is
    drained too while its engines are recorded: they are cold-started elsewhere."""
    if node not in view.nodes and not any(e.node == node for e in view.engines.values()):
        raise NotFound(f"no node {node}")  # one gone from etcd whose engines are still recorded can be drained
    await store.put(f"drain/{node}", {"node": node})
    engines = sorted(e.engine_id for e in view.engines.values() if e.node == node)
    started, left = [], {}
    for engine_id in engines:
        engine = view.engines[engine_id]
        if engine.role is not EngineRole.ACTIVE or engine.state != "ready":
            # a standby is the agent's to replace; a starting or failed one is not serving
            left[engine_id] = f"{engine.role}/{engine.state}: not a serving engine"
            continue
        try:
            rec = await start_on_purpose(store, view, engine_id, IncidentReason.MANUAL_FAILOVER, move_off=True,
                                         attempts=OPERATOR_ATTEMPTS)
        except Conflict as e:  # in an incident already (a repeated drain's, another's): that one moves it
            left[engine_id] = str(e)
            continue
        started.append(rec.id)
    return engines, started, left
