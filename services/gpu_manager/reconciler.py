"""The reconciler's decisions, as a pure function of the lease table, the clock and process liveness.

Level-triggered: each pass looks at every live lease and says what should happen, so a missed pidfd
notice or a manager restart cannot leave a lease behind.
1. An ACTIVE lease whose owner process is gone becomes ORPHANED (its grace window starts).
2. An ORPHANED or FROZEN lease whose deadline has passed is reclaimed (memory freed).
3. A SLEEPING lease whose owner process is gone is reclaimed (it holds no memory to hand on).
4. Nothing else changes: a FROZEN lease with a dead owner waits for its successor until its deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from libs.common.events import LeaseState
from services.gpu_manager.fsm import WAITING, LeaseEvent
from services.gpu_manager.records import LeaseRecord


def plan(records: Iterable[LeaseRecord], now: float,
         owner_alive: Callable[[LeaseRecord], bool]) -> list[tuple[str, LeaseEvent]]:
    out: list[tuple[str, LeaseEvent]] = []
    for rec in records:
        state = rec.info.state
        if state in (LeaseState.ACTIVE, LeaseState.SLEEPING) and not owner_alive(rec):
            out.append((rec.id, LeaseEvent.OWNER_LOST))
        elif state in WAITING and rec.info.deadline is not None and rec.info.deadline <= now:
            out.append((rec.id, LeaseEvent.DEADLINE))
    return out
