"""Which controller term a command may act in: only the one leading when it is handled (issue 20). The one rule
every receiver of the controller's commands applies: the dc_manager to recover intents (services/dc_manager/terms.py),
the agent to stops (services/agent/commands.py).

The controller stamps what it sends with its leader term (`LeaderElection.term`: the create revision of
`leader/controller`, unique to one tenure). A controller that lost its lease between its leader check and its
publish (a pause, a swap storm) sends a term that has ended; its etcd writes fail the fence, its messages do not, so
their receivers hold the term against etcd's, read linearizably, and refuse an ended one.

Rules (tests/dc_manager/test_stale_term.py, tests/agent/test_stale_term.py):
1. A command runs only if its term is the controller's term in etcd when it is handled; one of an older term, or
   sent while nobody leads, is refused: `StaleTerm` (`stale_term`).
2. A term newer than etcd's (a read that raced an election, an etcd restored from a backup) is not refused for
   good: `Unavailable`, try again.
3. A command without a term (0: an operator's, a tool's, an older controller's) is not checked.
"""

from __future__ import annotations

from libs.common.errors import HoldfastError, StaleTerm, Unavailable
from libs.common.store import LeaderElection, Store

ELECTION = "controller"  # the controller's LeaderElection name (services/controller/app.py): leader/controller


async def current_term(store: Store) -> int:
    """The controller's term now (0: nobody leads), read linearizably (one etcd round trip)."""
    return await LeaderElection.current_term(store, ELECTION)


def refusal(term: int, current: int) -> HoldfastError | None:
    """Why a command of `term` may not run while `current` leads (rules 1 to 3); None: it may."""
    if term == 0 or term == current:
        return None
    if current == 0:
        return StaleTerm(f"sent in controller term {term}, which has ended (no controller leads now)")
    if term < current:
        return StaleTerm(f"sent in controller term {term}; term {current} leads now")
    return Unavailable(f"sent in controller term {term}, newer than etcd's {current}: try again")
