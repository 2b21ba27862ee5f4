"""Crash-loop backoff per engine spec (pure: no I/O, times are passed in).

An engine of a spec that fails soon after its start counts as one more consecutive failure of that spec;
the replacement then waits `base_s * 2**(failures - 2)` (the first failure is replaced at once: one crash is
a takeover's business, not a loop), capped at `max_s`. An engine that stayed up `reset_s` resets the count:
when it fails, that failure is the first again, and while it keeps running the count is cleared by
`note_up()` (so ListEngines does not report an old loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackoffPolicy:
    base_s: float = 0.5
    max_s: float = 30.0
    reset_s: float = 30.0

    def delay(self, failures: int) -> float:
        if failures <= 1:
            return 0.0
        return min(self.max_s, self.base_s * 2 ** (failures - 2))


@dataclass
class SpecBackoff:
    failures: int = 0
    delay_s: float = 0.0
    not_before: float = 0.0  # monotonic: no replacement starts earlier


@dataclass
class Backoffs:
    policy: BackoffPolicy = field(default_factory=BackoffPolicy)
    by_key: dict[str, SpecBackoff] = field(default_factory=dict)

    def failed(self, key: str, now: float, uptime_s: float) -> float:
        """An engine of `key` failed after `uptime_s`; returns how long its replacement waits."""
        b = self.by_key.setdefault(key, SpecBackoff())
        if uptime_s >= self.policy.reset_s:
            b.failures = 0
        b.failures += 1
        b.delay_s = self.policy.delay(b.failures)
        b.not_before = now + b.delay_s
        return b.delay_s

    def note_up(self, key: str, now: float, up_since: float) -> None:
        """An engine of `key` has been running since `up_since`: past `reset_s`, the loop is over."""
        b = self.by_key.get(key)
        if b is not None and now - up_since >= self.policy.reset_s and now >= b.not_before:
            del self.by_key[key]

    def may_start(self, key: str, now: float) -> bool:
        b = self.by_key.get(key)
        return b is None or now >= b.not_before

    def retry_in(self, key: str, now: float) -> float:
        b = self.by_key.get(key)
        return 0.0 if b is None else max(0.0, b.not_before - now)
