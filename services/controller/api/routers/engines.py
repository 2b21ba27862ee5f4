from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from libs.common.errors import Conflict, NotFound
from libs.common.events import IncidentReason, SleepEngine, SleepEngineReply
from services.controller.api.auth import require_admin, require_operate, require_read
from services.controller.api.context import ApiContext, ctx
from services.controller.api.pagination import PageParams, page_params, paginate
from services.controller.api.routers.errors import ONE_ERRORS, READ_ERRORS, WRITE_ERRORS
from services.controller.api.schemas import (
    EngineOut,
    FailoverIn,
    IncidentSummary,
    Page,
    UpgradeIn,
    UpgradeOut,
    UpgradeStepOut,
)
from services.controller.operations import OPERATOR_ATTEMPTS, regroup_refusal, start_on_purpose
from services.controller.rollout import RolloutRecord, RolloutState, pending_engines, rollout_key

router = APIRouter(tags=["engines"])


def _out(c: ApiContext, engine_id: str) -> EngineOut:
    e = c.view.engines[engine_id]
    inc = c.view.open_incident_for(engine_id)
    return EngineOut(**e.model_dump(), open_incident=inc.id if inc else None)


@router.get("/v1/engines", response_model=Page[EngineOut], dependencies=[Depends(require_read)], responses=READ_ERRORS)
def list_engines(node: str | None = Query(None, max_length=200), model: str | None = Query(None, max_length=200),
                 engine_class: str | None = Query(None, max_length=200), p: PageParams = Depends(page_params),
                 c: ApiContext = Depends(ctx)) -> Page[EngineOut]:
    rows = [_out(c, eid) for eid, e in sorted(c.view.engines.items())
            if (node is None or e.node == node) and (model is None or e.model == model)
            and (engine_class is None or e.engine_class == engine_class)]
    return paginate(rows, p)


@router.get("/v1/engines/{engine_id}", response_model=EngineOut, dependencies=[Depends(require_read)],
            responses=ONE_ERRORS)
def get_engine(engine_id: str = Path(..., max_length=200), c: ApiContext = Depends(ctx)) -> EngineOut:
    if engine_id not in c.view.engines:
        raise NotFound(f"no engine {engine_id}")
    return _out(c, engine_id)


@router.post("/v1/engines/{engine_id}/failover", status_code=202, response_model=IncidentSummary,
             dependencies=[Depends(require_operate)], responses=WRITE_ERRORS)
async def failover(engine_id: str = Path(..., max_length=200), body: FailoverIn | None = Body(None),
                   c: ApiContext = Depends(ctx)) -> IncidentSummary:
    rec = await start_on_purpose(c.store, c.view, engine_id, IncidentReason.MANUAL_FAILOVER,
                                 successor=body.successor if body else None, attempts=OPERATOR_ATTEMPTS)
    return IncidentSummary.of(rec)


@router.post("/v1/engines/{engine_id}/regroup", status_code=202, response_model=IncidentSummary,
             dependencies=[Depends(require_operate)], responses=WRITE_ERRORS)
async def regroup(engine_id: str = Path(..., max_length=200), c: ApiContext = Depends(ctx)) -> IncidentSummary:
    """A degraded engine (fewer ranks than its spec: one engine or a smaller group, after its group lost a GPU)
    replaced by a whole group on its node, every sequence continued from its KV backups (a `regroup` incident). 409 when it is not such an
    engine, keeps no backup, or its node has too few healthy GPUs; 404 unknown engine."""
    why = regroup_refusal(c.view, engine_id)
    if why is not None:
        raise Conflict(why)
    rec = await start_on_purpose(c.store, c.view, engine_id, IncidentReason.REGROUP, attempts=OPERATOR_ATTEMPTS)
    return IncidentSummary.of(rec)


class SleepIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: int = Field(1, ge=1, le=2, description="1: release the KV cache; 2: the weights too (kept by a node copy)")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="how long the engine has to quiesce and answer")


def _node_of(c: ApiContext, engine_id: str) -> str:
    """The engine's node: its record, else its leases' (an engine the view knows only by its leases)."""
    e = c.view.engines.get(engine_id)
    if e is not None:
        return e.node
    leases = c.view.leases_of(engine_id)
    if not leases:
        raise NotFound(f"no engine {engine_id}")
    return leases[0].node


async def _sleep_or_wake(c: ApiContext, engine_id: str, body: SleepIn | None, wake: bool) -> SleepEngineReply:
    body = body or SleepIn()
    cmd = SleepEngine(engine_id=engine_id, level=body.level, wake=wake, timeout_s=body.timeout_s)
    return await c.bus.request(_node_of(c, engine_id), cmd, SleepEngineReply, timeout=body.timeout_s + 10)


@router.post("/v1/engines/{engine_id}/sleep", response_model=SleepEngineReply, dependencies=[Depends(require_operate)],
             responses=WRITE_ERRORS)
async def sleep(engine_id: str = Path(..., max_length=200), body: SleepIn | None = Body(None),
                c: ApiContext = Depends(ctx)) -> SleepEngineReply:
    """The engine quiesces and releases its KV cache's physical memory, keeping its addresses (level 2: its weights
    too); answered once it did, with the bytes released. 404 unknown engine, 409 asleep already or mid-incident."""
    return await _sleep_or_wake(c, engine_id, body, wake=False)


@router.post("/v1/engines/{engine_id}/wake", response_model=SleepEngineReply, dependencies=[Depends(require_operate)],
             responses=WRITE_ERRORS)
async def wake(engine_id: str = Path(..., max_length=200), body: SleepIn | None = Body(None),
               c: ApiContext = Depends(ctx)) -> SleepEngineReply:
    """New memory at the sleeping engine's addresses (level 2: its weights restored); 409 if it is not asleep."""
    return await _sleep_or_wake(c, engine_id, body, wake=True)


def _upgrade_out(c: ApiContext, rec: RolloutRecord, skipped: dict[str, str] | None = None) -> UpgradeOut:
    incidents = [IncidentSummary.of(c.view.incidents[s.incident_id]) for s in rec.steps
                 if s.incident_id in c.view.incidents]
    pending = [] if rec.state is not RolloutState.RUNNING else \
        [e.engine_id for e in pending_engines(rec, c.view.engines) if all(s.engine_id != e.engine_id for s in rec.steps)]
    return UpgradeOut(engine_class=rec.engine_class, version=rec.version, state=rec.state.value, failure=rec.failure,
                      steps=[UpgradeStepOut(**s.model_dump()) for s in rec.steps], pending=pending,
                      incidents=incidents, skipped=skipped or {}, started_at=rec.started_at,
                      updated_at=rec.updated_at)


@router.post("/v1/engine-classes/{engine_class}/upgrade", status_code=202, response_model=UpgradeOut,
             dependencies=[Depends(require_admin)], responses=WRITE_ERRORS)
async def upgrade(body: UpgradeIn, engine_class: str = Path(..., max_length=200),
                  c: ApiContext = Depends(ctx)) -> UpgradeOut:
    """Rolling hot upgrade: the class's serving engines are taken over by successors of `version`, one at a
    time, each after the previous one's incident resolved; a failed incident stops the roll-out
    (GET this path for its progress)."""
    of_class = sorted((e for e in c.view.engines.values() if e.engine_class == engine_class and e.role == "active"),
                      key=lambda e: e.engine_id)
    if not of_class:
        raise NotFound(f"no serving engine of class {engine_class}")
    skipped = {e.engine_id: f"already at version {body.version}" for e in of_class if e.version == body.version}
    if len(skipped) == len(of_class):
        raise Conflict(f"every engine of class {engine_class} already runs version {body.version}")
    key = rollout_key(engine_class)
    raw, revision = await c.store.get_with_revision(key)
    if raw is not None:
        current = RolloutRecord.model_validate_json(raw)
        if current.state is RolloutState.RUNNING:
            raise Conflict(f"a roll-out of {engine_class} to version {current.version} is running")
    rec = RolloutRecord(engine_class=engine_class, version=body.version)
    # Compare-and-swap on the revision read: two concurrent requests cannot both start a roll-out.
    if not await c.store.cas_revision(key, revision, rec):
        raise Conflict(f"another roll-out of {engine_class} was started meanwhile")
    return _upgrade_out(c, rec, skipped)


@router.get("/v1/engine-classes/{engine_class}/upgrade", response_model=UpgradeOut,
            dependencies=[Depends(require_read)], responses=ONE_ERRORS)
async def upgrade_status(engine_class: str = Path(..., max_length=200), c: ApiContext = Depends(ctx)) -> UpgradeOut:
    """The class's latest roll-out: its state, each engine's step, and why it stopped if it failed."""
    raw = await c.store.get(rollout_key(engine_class))
    if raw is None:
        raise NotFound(f"no roll-out of class {engine_class}")
    return _upgrade_out(c, RolloutRecord.model_validate_json(raw))
