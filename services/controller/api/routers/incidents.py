from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query

from libs.common.errors import NotFound
from libs.common.events import IncidentReason
from services.controller.api.auth import require_read
from services.controller.api.context import ApiContext, ctx
from services.controller.api.pagination import PageParams, page_params, paginate
from services.controller.api.routers.errors import ONE_ERRORS, READ_ERRORS
from services.controller.api.schemas import IncidentDetail, IncidentSummary, Page, TimelineEntry
from services.controller.incident import IncidentState

router = APIRouter(prefix="/v1/incidents", tags=["incidents"], dependencies=[Depends(require_read)])


@router.get("", response_model=Page[IncidentSummary], responses=READ_ERRORS)
def list_incidents(state: IncidentState | None = None, reason: IncidentReason | None = None,
                   engine: str | None = Query(None, max_length=200), open_only: bool = False,
                   p: PageParams = Depends(page_params), c: ApiContext = Depends(ctx)) -> Page[IncidentSummary]:
    """Newest first."""
    rows = [IncidentSummary.of(r) for r in sorted(c.view.incidents.values(), key=lambda r: (-r.opened_at, r.id))
            if (state is None or r.state == state) and (reason is None or r.reason == reason)
            and (engine is None or r.engine_id == engine) and (not open_only or not r.terminal)]
    return paginate(rows, p)


@router.get("/{incident_id}", response_model=IncidentDetail, responses=ONE_ERRORS)
def get_incident(incident_id: str = Path(..., max_length=200), c: ApiContext = Depends(ctx)) -> IncidentDetail:
    rec = c.view.incidents.get(incident_id)
    if rec is None:
        raise NotFound(f"no incident {incident_id}")
    return IncidentDetail(record=rec, timings_ms=rec.timings_ms(),
                          timeline=[TimelineEntry.model_validate(t) for t in rec.timeline()])
