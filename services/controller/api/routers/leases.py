from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from libs.common.errors import NotFound
from libs.common.events import LeaseState, SnapshotLease, SnapshotReply
from services.controller.api.auth import require_admin, require_operate, require_read
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


class SnapshotIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    artifact: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                 description="artifact name (default `<engine class>.<lease name>`)")
    host_tier: bool = Field(False, description="also keep a copy in the node's host memory")


SNAPSHOT_WAIT_S = 900.0  # the node answers once the artifact is whole on disk: 120 GiB at a few GiB/s


@router.post("/{lease_id}/snapshot", response_model=SnapshotReply, dependencies=[Depends(require_operate)],
             responses=WRITE_ERRORS)
async def snapshot(lease_id: str = Path(..., max_length=200), body: SnapshotIn | None = Body(None),
                   c: ApiContext = Depends(ctx)) -> SnapshotReply:
    """Write a committed lease to a weight artifact on its node (docs/restore.md); 409 if not committed."""
    lease = c.view.leases.get(lease_id)
    if lease is None:
        raise NotFound(f"no lease {lease_id}")
    body = body or SnapshotIn()
    cmd = SnapshotLease(lease_id=lease_id, artifact=body.artifact, host_tier=body.host_tier)
    return await c.bus.request(lease.node, cmd, SnapshotReply, timeout=SNAPSHOT_WAIT_S)
