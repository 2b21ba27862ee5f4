"""`BusOutages`: when this controller's bus was down, so that a step's deadline counts only the time it could act.

A step's deadline (freeze, reattach, ...) runs on the wall clock. While the controller's NATS connection is down
nothing of the step can reach it (the dc_manager's results, the engines' events), so a bus outage longer than the
step's budget found it missed at once when the bus came back: a 7 s NATS restart just after an engine's SIGKILL
sent a cold-start fallback beside the takeover that was about to succeed, the fallback took the node's active
slot and the warm standby went unused (3 of 8 trials of a probe of 2026-12-07). Pure: the deadline pass tells it,
each tick, when the bus last answered (a PING's PONG: a server stopped, SIGSTOP or a frozen host, keeps the
connection open and nats-py "connected" while nothing crosses it).

Invariants: `down_within(since, now)` is the time between `since` and `now` during which the bus did not answer:
from its last answer before a silence longer than `silent_s`, to the first tick that saw it answer again; spans
older than `keep_s` are forgotten; an outage still under way counts up to `now`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class BusOutages:
    keep_s: float = 600.0
    silent_s: float = 1.0  # no answer for this long: the bus is down (since its last answer)
    spans: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    down_from: float | None = None  # the bus's last answer before it went silent, while it is

    def observe(self, now: float, answered_at: float) -> None:
        """`answered_at`: when the bus last answered (now's clock)."""
        silent = now - answered_at > self.silent_s
        if silent and self.down_from is None:
            self.down_from = answered_at
        elif not silent and self.down_from is not None:
            self.spans.append((self.down_from, now))
            self.down_from = None
        while self.spans and self.spans[0][1] < now - self.keep_s:
            self.spans.popleft()

    @property
    def down(self) -> bool:
        return self.down_from is not None

    def down_within(self, since: float, now: float) -> float:
        total = sum(max(0.0, min(end, now) - max(start, since)) for start, end in self.spans)
        if self.down_from is not None:
            total += max(0.0, now - max(self.down_from, since))
        return total
