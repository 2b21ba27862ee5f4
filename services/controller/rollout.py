"""Rolling hot upgrade of an engine class (pure: no I/O).

A roll-out is `rollouts/<engine_class>` in etcd. One engine at a time is replaced by a successor of the new
version through a `hot_upgrade` incident; the next one starts only after that incident resolved. A failed
incident stops the roll-out (state `failed`, with the reason). The next target is chosen afresh each pass
(level-triggered): an engine replaced meanwhile by a failure incident is upgraded through its successor.

Invariants (README):
- at most one upgrade incident of a roll-out is open at a time;
- an engine is tried at most once per roll-out (a failure does not retry it: the roll-out stops);
- the incident id is derived from the engine and generation, so a leader that died between creating the
  incident and recording it in the roll-out adopts it instead of opening a second one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, Field

from libs.common.events import EngineInfo, EngineRole, IncidentReason
from services.controller.incident import IncidentRecord, IncidentState, incident_id_for


class RolloutState(StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class RolloutStep(BaseModel):
    engine_id: str
    incident_id: str
    state: str = "upgrading"  # upgrading | done | failed
    successor_id: str | None = None
    detail: str = ""


class RolloutRecord(BaseModel):
    engine_class: str
    version: str
    state: RolloutState = RolloutState.RUNNING
    steps: list[RolloutStep] = Field(default_factory=list)
    started_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    failure: str | None = None

    @property
    def current(self) -> RolloutStep | None:
        return next((s for s in self.steps if s.state == "upgrading"), None)


def rollout_key(engine_class: str) -> str:
    return f"rollouts/{engine_class}"


def pending_engines(rec: RolloutRecord, engines: Mapping[str, EngineInfo]) -> list[EngineInfo]:
    """Serving engines of the class still below the roll-out's version and not tried yet, in id order."""
    tried = {s.engine_id for s in rec.steps}
    return sorted((e for e in engines.values()
                   if e.engine_class == rec.engine_class and e.role is EngineRole.ACTIVE
                   and e.version != rec.version and e.engine_id not in tried
                   and e.state not in ("failed", "stopped", "stopping")),
                  key=lambda e: e.engine_id)


@dataclass
class Decision:
    record: RolloutRecord  # the record to write (unchanged when `changed` is False)
    changed: bool = False
    start: EngineInfo | None = None  # open a hot_upgrade incident for this engine, then record it


def advance(rec: RolloutRecord, engines: Mapping[str, EngineInfo], incidents: Mapping[str, IncidentRecord],
            open_incident_for: Mapping[str, str], now: float) -> Decision:
    """One pass over a roll-out: settle its current step, then pick the next engine (or finish)."""
    if rec.state is not RolloutState.RUNNING:
        return Decision(rec)
    rec = rec.model_copy(deep=True)
    changed = False
    cur = rec.current
    if cur is not None:
        inc = incidents.get(cur.incident_id)
        if inc is None or not inc.terminal:
            return Decision(rec)  # still being upgraded (or its record not seen yet)
        changed = True
        rec.updated_at = now
        if inc.state is IncidentState.RESOLVED:
            cur.state, cur.successor_id = "done", inc.successor_id
        else:
            cur.state, cur.detail = "failed", inc.failure or inc.state.value
            rec.state = RolloutState.FAILED
            rec.failure = f"engine {cur.engine_id}: incident {cur.incident_id} failed: {cur.detail}; roll-out stopped"
            return Decision(rec, changed=True)

    waiting = False
    for e in pending_engines(rec, engines):
        inc_id = incident_id_for(e.engine_id, e.generation, IncidentReason.HOT_UPGRADE)
        if inc_id in incidents:  # ours, created by a leader that died before recording it
            rec.steps.append(RolloutStep(engine_id=e.engine_id, incident_id=inc_id))
            rec.updated_at = now
            return Decision(rec, changed=True)
        if e.engine_id in open_incident_for or e.state != "ready":
            waiting = True  # in a failure incident or starting: its turn comes when it serves again
            continue
        return Decision(rec, changed=changed, start=e)
    if not waiting:
        rec.state, rec.updated_at, changed = RolloutState.DONE, now, True
    return Decision(rec, changed=changed)


def with_started(rec: RolloutRecord, engine: EngineInfo, now: float) -> RolloutRecord:
    """The record once the incident for `engine` has been created."""
    rec = rec.model_copy(deep=True)
    rec.steps.append(RolloutStep(engine_id=engine.engine_id,
                                 incident_id=incident_id_for(engine.engine_id, engine.generation,
                                                             IncidentReason.HOT_UPGRADE)))
    rec.updated_at = now
    return rec
