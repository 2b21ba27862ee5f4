"""The lease state machine (DESIGN.md section 3) as one table. Pure: no I/O.

    ACTIVE   --owner_lost-->  ORPHANED --reattach/takeover--> ACTIVE (epoch+1)
    ACTIVE   --freeze-->      FROZEN   --takeover-->          ACTIVE (epoch+1, owner = successor)
    ORPHANED --freeze-->      FROZEN   (the control plane freezes after the fast path already orphaned it)
    ORPHANED/FROZEN --deadline--> RECLAIMED        ACTIVE --release--> RECLAIMED
    ORPHANED/FROZEN --reclaim-->  RECLAIMED        any live state --force_reclaim--> RECLAIMED
    FROZEN   --freeze / owner_lost--> FROZEN (idempotent: a frozen lease waits for its successor)
    FROZEN   --thaw-->        ACTIVE   (same owner and epoch: its incident failed, the owner serves on)
    ACTIVE   --sleep-->       SLEEPING --wake--> ACTIVE (same holder, same epoch: its addresses were kept)
    SLEEPING --owner_lost / release / reclaim / force_reclaim--> RECLAIMED (nothing to hand on: no memory)

Invariants (tests/gpu_manager/test_fsm.py checks them with hypothesis):
1. RECLAIMED is terminal: no event leaves it.
2. Epochs only grow, and grow exactly when a lease becomes ACTIVE again (a new read-write holder).
3. Every (state, event) pair not in the table raises InvalidTransition and changes nothing.
4. A SLEEPING lease holds no physical memory and is never frozen or handed on: its owner's death reclaims it
   (a sleeping KV cache is empty; the successor prefills again or the router replays).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from libs.common.errors import InvalidTransition
from libs.common.events import LeaseState

ACTIVE, ORPHANED, FROZEN, RECLAIMED = LeaseState.ACTIVE, LeaseState.ORPHANED, LeaseState.FROZEN, LeaseState.RECLAIMED
SLEEPING = LeaseState.SLEEPING


class LeaseEvent(StrEnum):
    OWNER_LOST = "owner_lost"  # the owner's process is gone (pidfd, socket close, reconciler)
    REATTACH = "reattach"  # the same engine id, in a new process, claims its orphaned leases
    FREEZE = "freeze"  # control plane: stop the clock, prepare a transfer
    TAKEOVER = "takeover"  # the named successor claims a frozen lease with the transfer token
    DEADLINE = "deadline"  # the grace window passed with nobody claiming
    RELEASE = "release"  # the owner gives the lease back
    RECLAIM = "reclaim"  # control plane: reclaim an unowned lease now
    FORCE_RECLAIM = "force_reclaim"  # control plane: reclaim even an active lease
    SLEEP = "sleep"  # the owner quiesced and unmapped it: its physical memory is released, its addresses kept
    WAKE = "wake"  # the owner maps new memory at the same addresses
    THAW = "thaw"  # control plane: the frozen lease's incident failed and its owner, alive, serves on


@dataclass(frozen=True)
class Outcome:
    state: LeaseState
    bump_epoch: bool = False


TRANSITIONS: MappingProxyType[tuple[LeaseState, LeaseEvent], Outcome] = MappingProxyType({
    (ACTIVE, LeaseEvent.OWNER_LOST): Outcome(ORPHANED),
    (ACTIVE, LeaseEvent.FREEZE): Outcome(FROZEN),
    (ACTIVE, LeaseEvent.RELEASE): Outcome(RECLAIMED),
    (ACTIVE, LeaseEvent.FORCE_RECLAIM): Outcome(RECLAIMED),
    (ORPHANED, LeaseEvent.REATTACH): Outcome(ACTIVE, bump_epoch=True),
    (ORPHANED, LeaseEvent.FREEZE): Outcome(FROZEN),
    (ORPHANED, LeaseEvent.DEADLINE): Outcome(RECLAIMED),
    (ORPHANED, LeaseEvent.RECLAIM): Outcome(RECLAIMED),
    (ORPHANED, LeaseEvent.FORCE_RECLAIM): Outcome(RECLAIMED),
    (FROZEN, LeaseEvent.FREEZE): Outcome(FROZEN),
    (FROZEN, LeaseEvent.OWNER_LOST): Outcome(FROZEN),
    (FROZEN, LeaseEvent.TAKEOVER): Outcome(ACTIVE, bump_epoch=True),
    (FROZEN, LeaseEvent.THAW): Outcome(ACTIVE),  # nobody else held it: the owner's mapping never stopped being valid
    (FROZEN, LeaseEvent.DEADLINE): Outcome(RECLAIMED),
    (FROZEN, LeaseEvent.RECLAIM): Outcome(RECLAIMED),
    (FROZEN, LeaseEvent.FORCE_RECLAIM): Outcome(RECLAIMED),
    (ACTIVE, LeaseEvent.SLEEP): Outcome(SLEEPING),
    (SLEEPING, LeaseEvent.WAKE): Outcome(ACTIVE),
    (SLEEPING, LeaseEvent.OWNER_LOST): Outcome(RECLAIMED),
    (SLEEPING, LeaseEvent.RELEASE): Outcome(RECLAIMED),
    (SLEEPING, LeaseEvent.RECLAIM): Outcome(RECLAIMED),
    (SLEEPING, LeaseEvent.FORCE_RECLAIM): Outcome(RECLAIMED),
})

# States whose memory a successor may still claim: the reconciler gives them a deadline.
WAITING = frozenset({ORPHANED, FROZEN})
LIVE = frozenset({ACTIVE, ORPHANED, FROZEN})  # holding memory (what capacity, GPU records and freezes count)
HELD = LIVE | {SLEEPING}  # not reclaimed: rows of the table, whether or not memory backs them


def transition(state: LeaseState, event: LeaseEvent) -> Outcome:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"a {state.value} lease cannot take '{event.value}'") from None


def allowed(state: LeaseState, event: LeaseEvent) -> bool:
    return (state, event) in TRANSITIONS
