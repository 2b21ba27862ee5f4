from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Path, Query

from libs.common.errors import Conflict, NotFound
from libs.common.events import IncidentReason
from services.controller.api.auth import require_admin, require_read
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
)
from services.controller.operations import start_on_purpose

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
             dependencies=[Depends(require_admin)], responses=WRITE_ERRORS)
async def failover(engine_id: str = Path(..., max_length=200), body: FailoverIn | None = Body(None),
                   c: ApiContext = Depends(ctx)) -> IncidentSummary:
    rec = await start_on_purpose(c.store, c.view, engine_id, IncidentReason.MANUAL_FAILOVER,
                                 successor=body.successor if body else None)
    return IncidentSummary.of(rec)


@router.post("/v1/engine-classes/{engine_class}/upgrade", status_code=202, response_model=UpgradeOut,
             dependencies=[Depends(require_admin)], responses=WRITE_ERRORS)
async def upgrade(body: UpgradeIn, engine_class: str = Path(..., max_length=200),
                  c: ApiContext = Depends(ctx)) -> UpgradeOut:
    """Hot upgrade: each serving engine of the class is taken over by a standby of `version`."""
    targets = sorted(eid for eid, e in c.view.engines.items() if e.engine_class == engine_class and e.role == "active")
    if not targets:
        raise NotFound(f"no serving engine of class {engine_class}")
    out = UpgradeOut(engine_class=engine_class, version=body.version, incidents=[])
    for eid in targets:
        if c.view.engines[eid].version == body.version:
            out.skipped[eid] = f"already at version {body.version}"
            continue
        try:
            rec = await start_on_purpose(c.store, c.view, eid, IncidentReason.HOT_UPGRADE, version=body.version)
        except Conflict as e:
            out.skipped[eid] = e.message
            continue
        out.incidents.append(IncidentSummary.of(rec))
    if not out.incidents:
        raise Conflict(f"no engine of class {engine_class} could be upgraded: {out.skipped}")
    return out
