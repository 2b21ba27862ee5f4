"""What every route needs, handed to the app once (no globals)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

from fastapi import Request

from libs.common.bus import Bus
from libs.common.store import Store
from libs.common.web.tokens import TokenTable
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
    tokens: TokenTable = field(default_factory=TokenTable)  # digests only (tokens.py)
    audit: AuditLog = field(default_factory=AuditLog)
    # Plain dev tokens (benchmarks, in-process tests): hashed into `tokens` and not kept.
    admin_token: InitVar[str] = ""
    read_token: InitVar[str] = ""

    def __post_init__(self, admin_token: str, read_token: str) -> None:
        self.tokens = self.tokens.with_plain(admin_token, read_token)


def ctx(request: Request) -> ApiContext:
    return request.app.state.ctx  # type: ignore[no-any-return]
