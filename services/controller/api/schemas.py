"""Response and request bodies of the admin API."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from libs.common.events import EngineInfo, FaultKind, IncidentReason, LeaseInfo
from services.controller.incident import IncidentRecord, IncidentState

T = TypeVar("T")


class ErrorOut(BaseModel):
    error: str
    message: str
    detail: list[dict[str, Any]] | None = None


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int
    next_offset: int | None = Field(None, description="offset of the next page; null on the last one")


class NodeOut(BaseModel):
    node: str
    datacenter: str = ""
    drained: bool = False
    gpus: list[int]
    engines: int
    info: dict[str, Any]


class GpuOut(BaseModel):
    node: str
    gpu: int
    healthy: bool
    total_bytes: int | None
    leased_bytes: int
    free_bytes: int | None
    engines: int


class EngineOut(EngineInfo):
    open_incident: str | None = None


class LeaseOut(LeaseInfo):
    pass


class IncidentSummary(BaseModel):
    id: str
    engine_id: str
    model: str
    reason: IncidentReason
    kind: FaultKind | None
    state: IncidentState
    opened_at: float
    total_ms: float | None
    fallback: bool
    successor_id: str | None
    failure: str | None

    @classmethod
    def of(cls, rec: IncidentRecord) -> IncidentSummary:
        return cls(id=rec.id, engine_id=rec.engine_id, model=rec.model, reason=rec.reason, kind=rec.kind,
                   state=rec.state, opened_at=rec.opened_at, total_ms=rec.total_ms(), fallback=rec.fallback,
                   successor_id=rec.successor_id, failure=rec.failure)


class TimelineEntry(BaseModel):
    at: float
    step: str
    event: str
    detail: str = ""


class IncidentDetail(BaseModel):
    record: IncidentRecord
    timings_ms: dict[str, float]
    timeline: list[TimelineEntry]


class FailoverIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt `successor` is refused, not a failover to any standby
    successor: str | None = Field(None, max_length=200, description="a standby engine to take over; none: the agent picks")


class UpgradeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str = Field(..., min_length=1, max_length=100, description="the engine version to upgrade to")


class UpgradeStepOut(BaseModel):
    engine_id: str
    incident_id: str
    state: str = Field(..., description="upgrading | done | failed")
    successor_id: str | None = None
    detail: str = ""


class UpgradeOut(BaseModel):
    """A rolling upgrade: one engine at a time, the next after the previous incident resolved."""

    engine_class: str
    version: str
    state: str = Field("running", description="running | done | failed (a failed incident stops the roll-out)")
    failure: str | None = Field(None, description="why the roll-out stopped")
    steps: list[UpgradeStepOut] = Field(default_factory=list, description="engines upgraded or being upgraded, in order")
    pending: list[str] = Field(default_factory=list, description="engines still to upgrade, in order")
    incidents: list[IncidentSummary] = Field(default_factory=list, description="the steps' incidents")
    skipped: dict[str, str] = Field(default_factory=dict, description="engine id -> why it is not upgraded")
    started_at: float | None = None
    updated_at: float | None = None


class DrainOut(BaseModel):
    node: str
    drained: bool
    engines: list[str]
    incidents: list[str] = []  # the manual failovers started to move its serving engines off
    not_moved: dict[str, str] = {}  # each engine of the node this call did not move, and why


class HealthOut(BaseModel):
    ok: bool
    instance: str
    leader: bool
    synced: bool
    revision: int
