"""What a client on the engine socket may learn of leases that are not its uid's: nothing (issue 20).

Rules (checked by tests/gpu_manager/test_limits_listing_scope.py):
1. A request naming another uid's lease (`release`, `register`, `resume`, `sleep`, `wake`) is answered exactly as one
   naming an id that does not exist: the same code and message, raised by the same line, so no uid can tell which
   lease ids exist beyond its own. Another engine id's lease of the caller's own uid is still `permission_denied`:
   a uid is the boundary (its processes may read and signal each other anyway).
2. The same for an engine id whose leases are all another uid's: `attach` grants nothing, `takeover` is `not_found`,
   as for an engine id never seen (`pending` already lists nothing: session rule 7).
3. The manager logs the real reason (who asked, whose lease it is), the 1st, 2nd, 4th... time, with the count, so a
   client probing ids cannot flood the log.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

from libs.common.errors import NotFound
from services.gpu_manager.records import LeaseRecord

log = logging.getLogger("holdfast.gpu_manager.scope")


_HIDDEN = itertools.count(1)  # requests answered as unknown that named another uid's leases


def hidden(what: str, owner_uid: int, *, asker: str, uid: int, pid: int) -> None:
    """Log (throttled: rule 3) that `what`, `owner_uid`'s, was answered as unknown to `asker` (uid, pid)."""
    n = next(_HIDDEN)
    if n & (n - 1) == 0:
        log.warning("%s belongs to uid %d: answered as unknown to %s (uid %d, pid %d); %d such requests so far",
                    what, owner_uid, asker, uid, pid, n)


def lease_for(records: Mapping[str, LeaseRecord], lease_id: str, *, asker: str, uid: int, pid: int) -> LeaseRecord:
    """The live lease `lease_id` if `uid` owns it; `NotFound` alike for an unknown id and another uid's (rule 1)."""
    rec = records.get(lease_id)
    if rec is not None and rec.owner_uid != uid:
        hidden(f"lease {lease_id}", rec.owner_uid, asker=asker, uid=uid, pid=pid)
        rec = None
    if rec is None:
        raise NotFound(f"no live lease {lease_id}")
    return rec


def foreign_owner(records: Mapping[str, LeaseRecord], owner: str, *, asker: str, uid: int, pid: int) -> bool:
    """Whether engine id `owner` has leases here and none of them is `uid`'s (rule 2: answered as unknown)."""
    uids = {r.owner_uid for r in records.values() if r.info.owner == owner}
    if not uids or uid in uids:
        return False
    hidden(f"engine id {owner}'s leases", min(uids), asker=asker, uid=uid, pid=pid)
    return True
