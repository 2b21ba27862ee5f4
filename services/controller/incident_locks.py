"""`IncidentLocks`: one lock per incident, held by whoever works on it (a batch, a background step, a read-back).

Not incident state (that is all in the records): only who may touch an incident right now.

Invariants:
1. At most one holder per incident: a lock is forgotten only once its incident has ended here and nobody holds
   it (forgotten while held, a second worker would take a fresh lock of the same incident at once).
2. A worker takes all the locks it needs at once, in one order (sorted, each once), and takes no other while it
   holds them: two batches never wait on each other in a cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Container, Iterable

from libs.common.bus import holding


class IncidentLocks:
    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._ended: list[str] = []  # ended here; their locks go once released (`forget_ended`)

    def __len__(self) -> int:
        return len(self._locks)

    def holding(self, inc_ids: Iterable[str]) -> contextlib.AbstractAsyncContextManager[None]:
        """Every incident's lock (invariant 2)."""
        return holding([self._lock(inc_id) for inc_id in sorted(set(inc_ids))])

    def held(self, inc_id: str) -> bool:
        lock = self._locks.get(inc_id)
        return lock is not None and lock.locked()

    def ended(self, inc_id: str) -> None:
        """The incident ended here: its lock is forgotten once released (invariant 1)."""
        self._ended.append(inc_id)

    def forget_ended(self, open_: Container[str]) -> None:
        """Forget the locks of the incidents that ended here, nobody holds, and are not open again (resumed)."""
        keep = []
        for inc_id in self._ended:
            if self.held(inc_id):
                keep.append(inc_id)
            elif inc_id not in open_:
                self._locks.pop(inc_id, None)
        self._ended = keep

    def _lock(self, inc_id: str) -> asyncio.Lock:
        lock = self._locks.get(inc_id)  # not setdefault: that builds a Lock on every call, used or not
        if lock is None:
            lock = self._locks[inc_id] = asyncio.Lock()
        return lock
