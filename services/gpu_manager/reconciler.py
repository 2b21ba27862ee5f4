"""The reconciler's decisions, as a pure function of the lease table, the gangs, the clock and process liveness.

Level-triggered: each pass looks at every live lease and says what should happen, so a missed pidfd
notice or a manager restart cannot leave a lease behind.
1. An ACTIVE lease whose owner process is gone becomes ORPHANED (its grace window starts).
2. An ORPHANED or FROZEN lease whose deadline has passed is reclaimed (memory freed).
3. A SLEEPING lease whose owner process is gone is reclaimed (it holds no memory to hand on).
4. Nothing else changes: a FROZEN lease with a dead owner waits for its successor until its deadline.
5. A gang's leases (gang.py: a tensor-parallel engine's ranks') are reclaimed by rules 2 and 3 together or not at
   all: only once every one of them is due (past its deadline, or asleep with its owner gone), then all in the
   same pass. So the gang's deadline is its latest lease's: its grace window starts when its last rank let go
   (ranks die some milliseconds apart; a freeze gives every lease one deadline), and no rank's shard is freed
   while another's waits for a successor group that would need both. Rule 1 stays per lease (orphaning frees
   nothing). A lease of the gang still held by a live process keeps every other one of the gang.
6. A gang that lost a committed lease (gang.broken: a rank's memory gone with its GPU, say) can never be taken over:
   its ORPHANED and FROZEN leases are due at once, without waiting for their deadline, so that the memory on the
   healthy GPUs is there for the group that replaces it; still all in one pass, once no lease of it is held.
   Except its KV backups while every rank still holds one (gang.degradable, gang.py invariant 10): host memory,
   the only copy of the group's caches, they wait out their deadline for a degraded group to take them over;
   the rest of the gang goes at once as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from libs.common.events import LeaseState, is_kv_backup
from services.gpu_manager.fsm import HELD, WAITING, LeaseEvent
from services.gpu_manager.gang import Gang, belongs, broken, degradable
from services.gpu_manager.records import LeaseRecord


def plan(records: Iterable[LeaseRecord], now: float, owner_alive: Callable[[LeaseRecord], bool],
         gangs: Iterable[Gang] = ()) -> list[tuple[str, LeaseEvent]]:
    recs = list(records)
    gangs = list(gangs)
    in_gang = {r.id for r in recs for g in gangs if belongs(g, r.info)}
    out: list[tuple[str, LeaseEvent]] = []
    for rec in recs:
        state = rec.info.state
        if state == LeaseState.ACTIVE and not owner_alive(rec):
            out.append((rec.id, LeaseEvent.OWNER_LOST))
        elif rec.id in in_gang:
            continue  # rules 2 and 3 for its gang as a whole, below
        elif (reclaim := _reclaim_event(rec, now, owner_alive)) is not None:
            out.append((rec.id, reclaim))
    done: set[str] = set()
    for gang in gangs:
        mine = [r for r in recs if r.id not in done and r.info.state in HELD and belongs(gang, r.info)]
        infos = [r.info for r in recs]
        lost = broken(gang, infos)
        kept = {r.id for r in mine if lost and is_kv_backup(r.info.name) and r.info.state in WAITING} \
            if lost and degradable(gang, infos) else set()
        events = [_reclaim_event(r, now, owner_alive, lost and r.id not in kept) for r in mine]
        # rule 5: every lease of the gang due, or none is reclaimed (rule 6: a backup kept waits on its own)
        if mine and all(e is not None or r.id in kept for r, e in zip(mine, events, strict=True)):
            out.extend((r.id, e) for r, e in zip(mine, events, strict=True) if e is not None)
            done.update(r.id for r, e in zip(mine, events, strict=True) if e is not None)
    return out


def _reclaim_event(rec: LeaseRecord, now: float, owner_alive: Callable[[LeaseRecord], bool],
                   gang_broken: bool = False) -> LeaseEvent | None:
    """The event that reclaims the lease now (rules 2, 3 and 6), or None while it is not due."""
    state = rec.info.state
    if state == LeaseState.SLEEPING and not owner_alive(rec):
        return LeaseEvent.OWNER_LOST
    if state in WAITING and gang_broken:
        return LeaseEvent.RECLAIM
    if state in WAITING and rec.info.deadline is not None and rec.info.deadline <= now:
        return LeaseEvent.DEADLINE
    return None
