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
3. An intent of a term newer than etcd's (a read that raced the election) is not refused: `unavailable`, redelivered.
4. An intent without a term (0: an older controller, a tool) is not checked.

Consequence of rule 1: an intent its leader sent just before its term ended and that is handled only after (this
manager down or far behind meanwhile) is refused too, since the two cannot be told apart here; the next leader
resumes the incident and its deadlines move it on (a recover intent's incident falls back to a cold start).

The term rule itself (`refusal`, `current_term`) is shared with the agent, which applies it to the controller's
stops: libs/common/terms.py, re-exported here for the executor.
"""

from __future__ import annotations

from libs.common.terms import current_term, refusal

__all__ = ["current_term", "refusal"]
