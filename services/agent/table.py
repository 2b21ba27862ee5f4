"""What the agent's parts (starts.py, detection.py, links.py, adoption.py, probes.py, gpu_health.py, takeover.py,
commands.py) see of the agent: protocols, so that none of them imports supervisor.py, whose `Agent` is each of them.
Each part's own `Host` adds to these only what that part needs.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

from libs.common.events import EngineInfo, EngineSpec, Event, FaultKind
from services.agent.engines import EngineRecord
from services.agent.pidfd import PidWatcher
from services.agent.settings import AgentSettings


class EngineTable(Protocol):
    """The node's engines: the settings, the specs, the records and their process watch, and publishing an event,
    saving a record (etcd) and running a background task."""

    settings: AgentSettings
    node: str
    specs: dict[str, EngineSpec]
    engines: dict[str, EngineRecord]
    watcher: PidWatcher

    def records(self) -> list[EngineRecord]: ...

    def info(self, rec: EngineRecord) -> EngineInfo: ...

    def publish(self, payload: Event) -> None: ...

    def save(self, rec: EngineRecord) -> None: ...

    def background(self, coro: Coroutine[Any, Any, Any], name: str) -> None: ...


class FaultReporter(Protocol):
    """Where an engine's failure goes: its generation's one `FaultDetected` (detection.py); False when it was
    already published."""

    def fault(self, rec: EngineRecord, kind: FaultKind, *, exit_code: int | None = None, sig: int | None = None,
              detail: str = "", died_at: float | None = None, rank: int | None = None) -> bool: ...
