from __future__ import annotations

from fastapi import APIRouter, Depends, Path

from services.controller.api.auth import require_operate, require_read
from services.controller.api.context import ApiContext, ctx
from services.controller.api.pagination import PageParams, page_params, paginate
from services.controller.api.routers.errors import READ_ERRORS, WRITE_ERRORS
from services.controller.api.schemas import DrainOut, NodeOut, Page
from services.controller.operations import drain_node

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


@router.get("", response_model=Page[NodeOut], dependencies=[Depends(require_read)], responses=READ_ERRORS)
def list_nodes(p: PageParams = Depends(page_params), c: ApiContext = Depends(ctx)) -> Page[NodeOut]:
    view = c.view
    engines: dict[str, int] = {}
    for e in view.engines.values():
        engines[e.node] = engines.get(e.node, 0) + 1
    rows = [NodeOut(node=n, datacenter=str(info.get("datacenter", "")), drained=n in view.drained,
                    gpus=view.node_gpus(n), engines=engines.get(n, 0), info=info)
            for n, info in sorted(view.nodes.items())]
    return paginate(rows, p)


@router.post("/{node_id}/drain", status_code=202, response_model=DrainOut, dependencies=[Depends(require_operate)],
             responses=WRITE_ERRORS)
async def drain(node_id: str = Path(..., max_length=200), c: ApiContext = Depends(ctx)) -> DrainOut:
    engines, incidents, left = await drain_node(c.store, c.view, node_id)
    return DrainOut(node=node_id, drained=True, engines=engines, incidents=incidents, not_moved=left)
