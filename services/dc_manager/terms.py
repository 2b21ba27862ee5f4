"""Which controller term an intent may act in: only the one leading when it is handled (issue 20).

The controller stamps each RecoverIntent with its leader term (`LeaderElection.term`: the create revision of
`leader/controller`, unique to one tenure). A controller that lost its lease between its leader check and its
publish (a pause, a swap storm) sends the intent of a term that has ended; run, it would freeze, take over or cold
start what the new leader did not ask for (a cold start beside the successor the new leader routed in). Its writes
fail the fence in etcd; its publications do not, so they are refused here.

Rules (tests/dc_manager/test_stale_term.py):
1. An intent runs only if its term is the controller's term in etcd when it is handled (one linearizable read per
   batch of intents); one of an older term, or sent while nobody leads, is refused: `stale_term`, logged, acked, no
   command and no result (its incident is the current leader's, which resumes it from its record and its deadlines).
2. A redelivered intent whose progress is recorded was accepted in its term: it goes on (its steps are idempotent).
3. An intent of a term newer than etcd's (a read that raced the election) is not refused: redelivered.
4. An intent without a term (0: an older controller, a tool) is not checked.

Consequence of rule 1: an intent its leader sent just before its term ended and that is handled only after (this
manager down or far behind meanwhile) is refused too, since the two cannot be told apart here; the next leader
resumes the incident and its deadlines move it on (a recover intent's incident falls back to a cold start).
"""

from __future__ import annotations

from libs.common.errors import HoldfastError, StaleTerm, Unavailable
from libs.common.store import LeaderElection, Store

ELECTION = "controller"  # the controller's LeaderElection name (services/controller/app.py): leader/controller


async def current_term(store: Store) -> int:
    """The controller's term now (0: nobody leads)."""
    return await LeaderElection.current_term(store, ELECTION)


def refusal(term: int, current: int) -> HoldfastError | None:
    """Why an intent of `term` may not run while `current` leads (rules 1, 3 and 4); None: it may."""
    if term == 0 or term == current:
        return None
    if current == 0:
        return StaleTerm(f"sent in controller term {term}, which has ended (no controller leads now)")
    if term < current:
        return StaleTerm(f"sent in controller term {term}; term {current} leads now")
    return Unavailable(f"sent in controller term {term}, newer than etcd's {current}: tried again")
