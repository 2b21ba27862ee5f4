"""Health, readiness and metrics: no auth (probes and scrapers); the audit record: admin only."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Response

from libs.common.web.tokens import allows
from services.controller.api.auth import require_read
from services.controller.api.context import ApiContext, ctx
from services.controller.api.schemas import HealthOut

router = APIRouter(tags=["system"])


def _health(c: ApiContext) -> HealthOut:
    return HealthOut(ok=not c.bus.nc.is_closed, instance=c.settings.instance, leader=c.is_leader(),
                     synced=c.view.synced.is_set(), revision=c.view.revision)


@router.get("/healthz", response_model=HealthOut)
def healthz(c: ApiContext = Depends(ctx)) -> HealthOut:
    """The process is up (liveness)."""
    return _health(c)


@router.get("/readyz", response_model=HealthOut, responses={503: {"model": HealthOut, "description": "not ready"}})
def readyz(response: Response, c: ApiContext = Depends(ctx)) -> HealthOut:
    """The view is loaded from etcd and NATS is connected: the API answers from current state."""
    h = _health(c)
    if not (h.ok and h.synced and c.bus.nc.is_connected):
        response.status_code = 503
    return h


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(c: ApiContext = Depends(ctx)) -> Response:
    """Prometheus text format."""
    return Response(c.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")



@router.get("/v1/audit")
def audit(limit: int = Query(100, ge=1, le=10_000), c: ApiContext = Depends(ctx),
          role: str = Depends(require_read)) -> dict[str, Any]:
    """The admin actions this controller instance served, newest first: who, what, when, outcome (admin only)."""
    if not allows(role, "admin"):
        raise HTTPException(403, "the audit record is for admin-scope tokens")
    return {"items": [asdict(e) for e in c.audit.newest(limit)]}
