"""How long finished work's records stay in etcd: ended incidents (`incidents/<id>`, the controller) and finished
intents' progress (`dcm/intents/<key>`, the dc_manager).

Without a limit every incident adds records for good: at hundreds of incidents a second etcd's keyspace and
the services' views grow without bound, and etcd's quota (2 GiB by default) ends in NOSPACE, which fails every
write of the control plane. Each owner deletes its records once they are older than `keep_s`, and the oldest
early while more than `keep_max` are kept, but never one younger than `min_s`: a message redelivered or retried
within that window still finds its record (the controller: no second incident for one failure; the dc_manager:
no second freeze). Records of work still running are never offered.

`due` is the policy (pure); `prune_forever` applies it through the owner's writer.
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
    per_pass: int = 2_000  # deletes queued per pass (each an etcd operation): a backlog drains over passes


def due(ended: Mapping[str, float], now: float, policy: Retention) -> list[str]:
    """Ids of the records to delete now. `ended`: id -> when its work ended, in that order (oldest first; an
    entry out of order only waits for the older ones before it)."""
    out: list[str] = []
    excess = len(ended) - policy.keep_max
    for inc_id, at in ended.items():
        if len(out) >= policy.per_pass:
            break
        age = now - at
        if age >= policy.keep_s or (len(out) < excess and age >= policy.min_s):
            out.append(inc_id)
        else:
            break  # oldest first: the rest are younger
    return out


async def prune_forever(ended: dict[str, float], delete: Callable[[str], None], policy: Retention,
                        every_s: float, what: str = "records") -> None:
    """Every `every_s`, delete what `due` names (`delete`: a written-behind delete of the record's key). Each id
    leaves `ended` at once (a view that keeps the records drops one when etcd's delete comes back)."""
    while True:
        await asyncio.sleep(every_s)
        ids = due(ended, time.time(), policy)
        for inc_id in ids:
            ended.pop(inc_id, None)
            delete(inc_id)
        if ids:
            log.info("deleted %d %s (%d kept)", len(ids), what, len(ended))
