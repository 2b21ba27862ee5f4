"""`Backoff`: exponential delays between attempts at something that keeps failing. Pure (no clock, no sleep:
the caller sleeps), and below every other module of libs.common so that the bus and the service runtime
both use this one rule."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Backoff:
    """Delays between attempts at something that keeps failing (a campaign, a child process, a publish):
    `first_s`, doubled after each failure, at most `max_s`. `reset()` after a success that lasted: the next
    failure waits `first_s` again. Invariant: delays never shrink between two resets, and never pass `max_s`."""

    first_s: float = 0.5
    max_s: float = 30.0
    failures: int = 0

    def next_delay(self) -> float:
        delay = min(self.max_s, self.first_s * (2 ** min(self.failures, 32)))
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0
