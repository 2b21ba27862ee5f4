"""`Intake`: what each consumed message means for the incidents: the incidents it opens, the `Move`s it makes.
Reads the cluster view and the leader's open table; no I/O, no state of its own.

- A fault opens its engine generation's incident (incident.py, invariants 1 and 7: a tensor-parallel group's,
  whichever rank faulted), unless that incident ended here; a further rank's fault joins it (`rank_faulted`);
  a fault of an engine already in another incident (replaced on purpose) that loses memory says that memory is
  gone (`memory_lost`); a fault of a fallback's own cold-started engine fails that fallback (`step_failed`).
- An engine reattached, a fallback's cold engine ready, a freeze reported, a lease of an incident's engine (or of
  any rank of its group) reclaimed: one move each. Not a memory loss: the KV cache's lease reclaimed while the
  engine's host backup of it (`is_kv_backup`; a TP rank's own) and its weights live (the successor restores the
  cache from the backup: engines/batched/backup.py), nor the backup's while the cache and the weights live
  (`recoverable_without`).
Standbys' faults open nothing (a standby holds no leased memory; the agent replaces it on its own), and a fault
naming another node's group is refused (the bus vets `engine_id`, this vets `group`).
"""

from __future__ import annotations

import logging

from libs.common.events import (
    EngineInfo,
    EngineReady,
    EngineReattached,
    EngineRole,
    Envelope,
    Event,
    FaultDetected,
    IncidentReason,
    LeaseChanged,
    LeaseInfo,
    LeaseState,
    MemoryFrozen,
    Tag,
    group_of_rank,
    is_kv_backup,
)
from libs.common.ids import cold_parent_of
from services.controller.incident import (
    IncidentRecord,
    IncidentState,
    Trigger,
    incident_id_for,
    opened_record,
)
from services.controller.moves import Move
from services.controller.open_incidents import OpenIncidents
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.intake")
S = IncidentState
Opening = tuple[int, FaultDetected, Envelope]  # a fault that opens its incident: its message, the fault, the envelope


def recoverable_without(lost: LeaseInfo, leases: list[LeaseInfo]) -> bool:
    """Whether an engine's memory is still enough for a reattach without `lost`: its KV cache lost while its host
    backup of the cache and its weights live, or the backup lost while the cache and the weights live."""
    live = [lease for lease in leases if lease.id != lost.id and lease.state is not LeaseState.RECLAIMED]
    weights = any(lease.tag is Tag.WEIGHTS for lease in live)
    if lost.tag is Tag.KV_CACHE:
        return weights and any(is_kv_backup(lease.name) for lease in live)
    if is_kv_backup(lost.name):
        return weights and any(lease.tag is Tag.KV_CACHE for lease in live)
    return False


def incident_of(f: FaultDetected) -> str:
    """incident.py, invariants 1 and 7: the failed generation's, a TP group's whichever rank faulted."""
    return incident_id_for(f.group or f.engine_id, f.generation)


class Intake:
    def __init__(self, view: ClusterView, open_: OpenIncidents) -> None:
        self.view = view
        self.open = open_

    def faults(self, envs: list[Envelope]) -> tuple[dict[str, Opening], list[Move]]:
        """Faults delivered in one loop pass: the incidents they open (by id, the first fault of each) and the
        moves they make on incidents already open."""
        opens: dict[str, Opening] = {}
        moves: list[Move] = []
        for i, env in enumerate(envs):
            f = env.data
            if not isinstance(f, FaultDetected) or f.role is EngineRole.STANDBY:
                continue  # a standby holds no leased memory; the agent replaces it on its own
            if f.group is not None and not self._group_on_node(f, env):
                continue
            parent = self._cold_parent(f.engine_id)
            if parent is not None:  # a fallback's own engine died before it served: that cold start failed
                moves.append(Move(i, parent, Trigger.STEP_FAILED, frozenset({S.FALLBACK}),
                                  detail=f"its cold-started engine {f.engine_id} failed ({f.kind}) before it was ready"))
            inc_id = incident_of(f)
            if self.open.closed_here(inc_id):
                continue  # ended here (its record may be gone already: libs/common/retention.py)
            if f.group is not None:  # a rank's fault joins its group's incident (no-op for the rank that opened it)
                moves.append(Move(i, inc_id, Trigger.RANK_FAULTED, changes={"rank": f.engine_id}))
            if inc_id in opens:
                continue  # a repeat, or another rank of the same group
            other = self.view.open_incident_for(f.group or f.engine_id)
            if other is not None and other.id != inc_id:
                if f.kind.loses_memory:
                    moves.append(Move(i, other.id, Trigger.MEMORY_LOST, detail=f"{f.kind.replace('_', ' ')} during the incident"))
                continue
            opens[inc_id] = (i, f, env)
        return opens, moves

    def event_move(self, e: Event) -> Move | None:
        """The move an engine or memory event makes, if any (a batch of one)."""
        if isinstance(e, EngineReattached):
            reattached = e.incident_id or (self.view.open_by_engine.get(e.predecessor_id) or "")
            if reattached:
                return Move(0, reattached, Trigger.REATTACHED, frozenset({S.FREEZING, S.REATTACHING, S.FALLBACK}),
                            changes={"successor_id": e.engine.engine_id, "successor_endpoint": e.engine.endpoint,
                                     **({"kv_source": e.engine.kv} if e.engine.kv else {})})
        elif isinstance(e, EngineReady):
            cold_of = self.open.incident_of_cold(e.engine.engine_id)
            if cold_of is not None:
                return cold_ready(cold_of, e.engine)
        elif isinstance(e, MemoryFrozen) and e.incident_id:
            return Move(0, e.incident_id, Trigger.FROZEN, frozenset({S.FREEZING}))
        elif isinstance(e, LeaseChanged) and e.lease.state is LeaseState.RECLAIMED:
            inc = self.view.open_incident_for(e.lease.owner) or self._group_incident_of(e.lease.owner)
            if inc is not None and recoverable_without(e.lease, self.view.leases_of(e.lease.owner)):
                log.info("incident %s: lease %s (%s) reclaimed; its engine's memory is still recoverable", inc.id,
                         e.lease.id, e.lease.name or e.lease.tag)
            elif inc is not None:
                return Move(0, inc.id, Trigger.MEMORY_LOST, frozenset({S.FREEZING, S.REATTACHING}),
                            detail=f"lease {e.lease.id} reclaimed", changes={"memory_lost": True})
        return None

    def record_from_fault(self, inc_id: str, f: FaultDetected, env: Envelope, leader: str) -> IncidentRecord:
        """The opened record of a fault's incident, from the fault and what the view knows of its engine."""
        engine_id = f.group or f.engine_id  # a TP group's incident is its rank 0's, the group's one endpoint
        engine = self.view.engines.get(engine_id)
        hit = self.view.endpoint_of(engine_id)
        return opened_record(
            id=inc_id, engine_id=engine_id, gang=f.gang or (engine.gang if engine else None),
            ranks_faulted=[f.engine_id] if f.group else [], model=f.model or (engine.model if engine else "") or (hit[0] if hit else ""),
            engine_class=f.engine_class if f.engine_class != "default" or engine is None else engine.engine_class,
            generation=f.generation, node=f.node or env.node or (engine.node if engine else None), gpu=f.gpu,
            endpoint=(hit[1] if hit else None) or (engine.endpoint if engine else None),
            reason=IncidentReason.FAILURE, kind=f.kind, died_at=f.died_at,
            memory_lost=f.kind.loses_memory, leader=leader,
        )

    def _cold_parent(self, engine_id: str) -> str | None:
        """The open incident in fallback whose cold start `engine_id` is, if any: the one recorded, or the one its
        id names (`cold_engine_id`: the engine may fail before the fallback's result records it)."""
        inc_id = self.open.incident_of_cold(engine_id) or cold_parent_of(engine_id)
        rec = self.open.get(inc_id) if inc_id else None
        return rec.id if rec is not None and rec.state is S.FALLBACK else None

    def _group_incident_of(self, owner: str) -> IncidentRecord | None:
        """The open incident of the TP group whose rank `owner` is (its leases are the group's memory), if any."""
        group = self.view.engines.get(group_of_rank(owner) or "")
        return self.view.open_incident_for(group.engine_id) if group is not None and owner in group.ranks else None

    def _group_on_node(self, f: FaultDetected, env: Envelope) -> bool:
        """A rank's fault names its group: refused (logged, acked) when that group's record is another node's."""
        group = self.view.engines.get(f.group or "")
        if group is None or group.node == env.node:
            return True
        log.warning("fault of %s from node %s names group %s of node %s: ignored", f.engine_id, env.node, f.group,
                    group.node)
        return False


def cold_ready(inc_id: str, engine: EngineInfo, at: int = 0) -> Move:
    """The fallback's cold-started engine reports ready: routed in (if it is still the incident's). How it loaded
    its weights and where its KV came from (the engine's reports: a KV backup restored) are the fallback step's
    detail in the timeline."""
    detail = "; ".join(x for x in (engine.weights.describe() if engine.weights else "", engine.kv or "") if x)
    return Move(at, inc_id, Trigger.SPAWNED, frozenset({S.FALLBACK}), detail,
                changes={"successor_id": engine.engine_id, "successor_endpoint": engine.endpoint})
