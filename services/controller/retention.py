"""How long ended incidents' records stay in etcd (`incidents/<id>`).

Without a limit every incident adds a record for good: at hundreds of incidents a second etcd's keyspace and
the controllers' views grow without bound, and etcd's quota (2 GiB by default) ends in NOSPACE, which fails
every write of the control plane. The leader deletes ended records (resolved, failed) once they are older than
`incident_retention_s`, and the oldest ones early while more than `incident_retention_max` are kept, but never
one ended less than `incident_retention_min_s` ago: a fault redelivered or retried within that window still
finds its record and does not open a second incident for the same failure. Open incidents are never touched.

`due` is the policy (pure); `prune_forever` applies it through the leader's fenced writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger("holdfast.controller.retention")


@dataclass(frozen=True)
class Retention:
    keep_s: float  # an ended record older than this goes
    keep_max: int  # more ended records than this: the oldest go early...
    min_s: float  # ...but none that ended less than this ago
    per_pass: int = 2_000  # deletes queued per pass (each an etcd operation): a backlog drains over passes


def due(ended: Mapping[str, float], now: float, policy: Retention) -> list[str]:
    """Ids of the ended records to delete now. `ended`: id -> when it ended, in the order they ended (oldest
    first; an entry out of order only waits for the older ones before it)."""
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
                        every_s: float) -> None:
    """Every `every_s`, delete what `due` names (`delete`: the fenced, written-behind delete of the record's
    key). Each id leaves `ended` at once: the view drops the record itself when etcd's delete comes back."""
    while True:
        await asyncio.sleep(every_s)
        ids = due(ended, time.time(), policy)
        for inc_id in ids:
            ended.pop(inc_id, None)
            delete(inc_id)
        if ids:
            log.info("deleted %d ended incident records (%d ended kept)", len(ids), len(ended))
