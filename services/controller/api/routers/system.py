"""Health, readiness and metrics: no auth (probes and scrapers)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

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
