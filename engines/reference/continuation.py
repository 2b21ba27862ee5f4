"""Generations in flight in a killed engine, continued by its successor before their requests come back.

Why: a promoted shadow learns of its promotion ~7 ms after the death (on an H200), and the router's replayed
requests reach it ~12 ms later; the agent tells it of the failure (`owner_down`) as it publishes the fault
(detected 1.3-2.4 ms after the death there). The predecessor's marks (kv_reuse.py) say, for each generation it had
in flight, the context with finished keys and values and the token it sampled next: the forward that resumes it
(that token, at its position, over the prefix copied from the predecessor's cache) is known before the request
arrives, so it runs at once; the request that comes back with that very context takes its slot and logits and
samples.

Invariants:
1. A continuation is the forward the request itself would run (EngineCore.prefill, same context, same prompt
   length, same prefix copied): a request that takes it continues exactly as it would have (engine.py
   invariant 1). A request takes only a continuation of its exact context and prompt length.
2. A continuation holds a slot until a request takes it; a request that finds no free slot takes the slot of
   an unclaimed one (the oldest), and the rest are dropped when the predecessor's cache is given back: in-flight
   generations that never come back cost one forward each, no capacity.
3. A request whose continuation is being computed waits for it rather than computing the same forward again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

Key = tuple[tuple[int, ...], int]  # (context, prompt length)


def key_of(context: Iterable[int], prompt_len: int) -> Key:
    return tuple(context), prompt_len


class Continuations:
    """Continuations planned, computed and taken, with the slots they hold (the state of invariants 2 and 3)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._pending: set[Key] = set()
        self._ready: dict[Key, tuple[int, torch.Tensor, int]] = {}  # insertion order: oldest first
        self.computed = 0
        self.taken = 0

    def plan(self, keys: Iterable[Key]) -> None:
        with self._cv:
            self._pending.update(keys)

    def done(self, key: Key, slot: int, logits: torch.Tensor, reused: int) -> None:
        with self._cv:
            self._pending.discard(key)
            self._ready[key] = (slot, logits, reused)
            self.computed += 1
            self._cv.notify_all()

    def abandon(self, key: Key) -> None:
        with self._cv:
            self._pending.discard(key)
            self._cv.notify_all()

    def take(self, key: Key, timeout: float | None = None) -> tuple[int, torch.Tensor, int] | None:
        """The slot, logits and positions reused of the continuation of `key`, waiting while it is computed
        (invariant 3); None if there is none."""
        with self._cv:
            if key not in self._pending and key not in self._ready:
                return None
            self._cv.wait_for(lambda: key not in self._pending, timeout=timeout)
            got = self._ready.pop(key, None)
            if got is not None:
                self.taken += 1
            return got

    def evict(self) -> int | None:
        """The slot of the oldest continuation no request took (invariant 2), or None."""
        with self._cv:
            if not self._ready:
                return None
            key = next(iter(self._ready))
            return self._ready.pop(key)[0]

    def drop_all(self) -> list[int]:
        """Every unclaimed continuation's slot; nothing waits any more."""
        with self._cv:
            slots = [slot for slot, _, _ in self._ready.values()]
            self._ready.clear()
            self._pending.clear()
            self._cv.notify_all()
            return slots

    def stats(self) -> dict[str, int]:
        with self._cv:
            return {"continued": self.computed, "continued_taken": self.taken}
