"""The audit record of the admin API: every state-changing call (failover, upgrade, reclaim, drain...), who made
it, what it was, when, and how it ended. Admin-only to list (`GET /v1/audit`), also written as one log line each
(logger `holdfast.audit`) so it outlives the process in the service's log.

Invariants: a write call that passed authentication is recorded exactly once, whether it succeeded or failed;
a token is never recorded, only a fingerprint that tells two tokens apart (its SHA-256, 12 hex digits);
the in-memory record keeps the newest `capacity` entries, each of a bounded size (`what` cut at `MAX_AUDIT_WHAT`
characters: a path longer than any route takes is refused, but still recorded).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field

log = logging.getLogger("holdfast.audit")
MAX_AUDIT_WHAT = 400  # a method and a path; every id in a path is at most 200 characters (the routes' Path limits)


def fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class AuditEntry:
    time: float
    who: str  # "<role> token <fingerprint> from <client address>"
    what: str  # "<METHOD> <path>"
    outcome: str  # "ok" or the error code / HTTP status it ended with


@dataclass
class AuditLog:
    capacity: int = 10_000
    entries: deque[AuditEntry] = field(init=False)

    def __post_init__(self) -> None:
        self.entries = deque(maxlen=self.capacity)

    def record(self, who: str, what: str, outcome: str) -> AuditEntry:
        if len(what) > MAX_AUDIT_WHAT:
            what = what[:MAX_AUDIT_WHAT - 1] + "…"
        entry = AuditEntry(time=time.time(), who=who, what=what, outcome=outcome)
        self.entries.append(entry)
        log.info("audit %s", asdict(entry))
        return entry

    def newest(self, limit: int) -> list[AuditEntry]:
        return list(self.entries)[-limit:][::-1]
