"""How long finished work's records stay in etcd: ended incidents (`incidents/<id>`, the controller) and finished
intents' progress (`dcm/intents/<key>`, the dc_manager).

Without a limit every incident adds records for good: at hundreds of incidents a second etcd's keyspace and
the services' views grow without bound, and etcd's quota (2 GiB by default) ends in NOSPACE, which fails every
write of the control plane. Each owner deletes its records once they are older than `keep_s`, and the oldest
early while more than `keep_max` are kept, but never one younger than `min_s`: a message redelivered or retried
within that window still finds its record (the controller: no second incident for one failure; the dc_manager:
no second freeze). Records of work still running are never offered.

`due` is the policy (pure); `prune_once` and `prune_forever` apply it through the owner's writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger("holdfast.retention")


@dataclass(frozen=True)
class Retention:
    keep_s: float  # a record older than this goes
    keep_max: int  # more records than this: the oldest go early...
    min_s: float  # ...but none younger than this
    per_pass: int = 2_000  # deletes queued at once (each an etcd operation); a full chunk is followed by the next


def due(ended: Mapping[str, float], now: float, policy: Retention) -> list[str]:
    """Ids of the records to delete now. `ended`: id -> when its work ended, in that order (oldest first; an
    entry out of order only waits for the older ones before it)."""
    out: list[str] = []
    excess = len(ended) - policy.keep_max
    for key, at in ended.items():
        if len(out) >= policy.per_pass:
            break
        age = now - at
        if age >= policy.keep_s or (len(out) < excess and age >= policy.min_s):
            out.append(key)
        else:
            break  # oldest first: the rest are younger
    return out


async def prune_once(ended: dict[str, float], delete: Callable[[str], None], policy: Retention) -> int:
    """Delete what `due` names (`delete`: a written-behind delete of the record's key), chunk after chunk until
    nothing more is due, so the pace keeps up with any rate of new records. Each key leaves `ended` at once (a
    view that keeps the records drops one when etcd's delete comes back). Returns how many."""
    deleted = 0
    while keys := due(ended, time.time(), policy):
        for key in keys:
            ended.pop(key, None)
            delete(key)
        deleted += len(keys)
        if len(keys) < policy.per_pass:
            break
        await asyncio.sleep(0)  # a large backlog: let the loop serve between chunks
    return deleted


async def prune_forever(ended: dict[str, float], delete: Callable[[str], None], policy: Retention,
                        every_s: float, what: str = "records") -> None:
    """`prune_once` every `every_s`."""
    while True:
        await asyncio.sleep(every_s)
        if deleted := await prune_once(ended, delete, policy):
            log.info("deleted %d %s (%d kept)", deleted, what, len(ended))
