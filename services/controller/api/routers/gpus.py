from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from services.controller.api.auth import require_read
from services.controller.api.context import ApiContext, ctx
from services.controller.api.pagination import PageParams, page_params, paginate
from services.controller.api.routers.errors import READ_ERRORS
from services.controller.api.schemas import GpuOut, Page

router = APIRouter(prefix="/v1/gpus", tags=["gpus"], dependencies=[Depends(require_read)])


@router.get("", response_model=Page[GpuOut], responses=READ_ERRORS)
def list_gpus(node: str | None = Query(None, max_length=200), healthy: bool | None = None,
              p: PageParams = Depends(page_params), c: ApiContext = Depends(ctx)) -> Page[GpuOut]:
    rows = [GpuOut(node=s.node, gpu=s.gpu, healthy=s.healthy, total_bytes=s.total_bytes, leased_bytes=s.leased_bytes,
                   free_bytes=s.free_bytes, engines=s.engines)
            for s in sorted(c.view.gpu_slots(), key=lambda s: (s.node, s.gpu))
            if (node is None or s.node == node) and (healthy is None or s.healthy == healthy)]
    return paginate(rows, p)
