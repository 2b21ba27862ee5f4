"""`Backoff`: exponential delays between attempts at something that keeps failing. No clock, no sleep (the
caller sleeps), and below every other module of libs.common so that the bus, the service runtime and the
memory SDK (libs.client) all use this one rule."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Backoff:
    """Delays between attempts at something that keeps failing (a campaign, a child process, a publish):
    `first_s`, doubled after each failure, at most `max_s`. `reset()` after a success that lasted: the next
    failure waits `first_s` again. `jitter` j (0 <= j < 1) draws each delay from [(1 - j) * d, d], so that many
    clients of one restarted server do not knock all at once. Invariant: the un-jittered delay d never shrinks
    between two resets, and no delay passes `max_s`."""

    first_s: float = 0.5
    max_s: float = 30.0
    failures: int = 0
    jitter: float = 0.0

    def next_delay(self) -> float:
        delay = min(self.max_s, self.first_s * (2 ** min(self.failures, 32)))
        self.failures += 1
        return delay * (1.0 - self.jitter * random.random()) if self.jitter else delay

    def reset(self) -> None:
        self.failures = 0
