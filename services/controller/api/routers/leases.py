from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query

from libs.common.events import LeaseState
from services.controller.api.auth import require_admin, require_read
from services.controller.api.context import ApiContext, ctx
from services.controller.api.pagination import PageParams, page_params, paginate
from services.controller.api.routers.errors import READ_ERRORS, WRITE_ERRORS
from services.controller.api.schemas import LeaseOut, Page
from services.controller.operations import reclaim_lease

router = APIRouter(prefix="/v1/leases", tags=["leases"])


@router.get("", response_model=Page[LeaseOut], dependencies=[Depends(require_read)], responses=READ_ERRORS)
def list_leases(node: str | None = Query(None, max_length=200), owner: str | None = Query(None, max_length=200),
                state: LeaseState | None = None, p: PageParams = Depends(page_params),
                c: ApiContext = Depends(ctx)) -> Page[LeaseOut]:
    rows = [LeaseOut(**lease.model_dump()) for lease in sorted(c.view.leases.values(), key=lambda x: (x.node, x.id))
            if (node is None or lease.node == node) and (owner is None or lease.owner == owner)
            and (state is None or lease.state == state)]
    return paginate(rows, p)


@router.post("/{lease_id}/reclaim", response_model=LeaseOut, dependencies=[Depends(require_admin)],
             responses=WRITE_ERRORS)
async def reclaim(lease_id: str = Path(..., max_length=200), c: ApiContext = Depends(ctx)) -> LeaseOut:
    reply = await reclaim_lease(c.bus, c.view, lease_id)
    return LeaseOut(**reply.lease.model_dump())
