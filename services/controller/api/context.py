"""What every route needs, handed to the app once (no globals)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from libs.common.bus import Bus
from libs.common.store import Store
from services.controller.api.audit import AuditLog
from services.controller.metrics import ControllerMetrics
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView


@dataclass
class ApiContext:
    settings: ControllerSettings
    view: ClusterView
    store: Store
    bus: Bus
    metrics: ControllerMetrics
    is_leader: Callable[[], bool]
    admin_token: str
    read_token: str = ""
    audit: AuditLog = field(default_factory=AuditLog)


def ctx(request: Request) -> ApiContext:
    return request.app.state.ctx  # type: ignore[no-any-return]
