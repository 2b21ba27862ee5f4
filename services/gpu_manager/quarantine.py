"""Rows set aside at start-up: one malformed row never takes the node's memory service down. Pure: no I/O.

A lease or gang row that `records.py` cannot read back (RowDefect), or a gang row that names leases it cannot hold,
is moved to the `quarantine` table (db.py `set_aside`, one transaction: the row leaves its table as its copy and
reason land there) and logged once; every other row is loaded as before. An operator reads the table to see what
was set aside and why.

Invariants (tests/gpu_manager/test_load_quarantine.py, test_quarantine.py):
1. A row is set aside whole or not at all, durably: the next start does not see it again (nor log it again).
2. A gang is loaded only if every lease it names is a row of this node (live, reclaimed, or a lease row set aside:
   then the gang is broken, as if that lease's memory were lost, and rule 6 of reconciler.py reclaims the rest),
   and no other gang loaded names the same lease. A gang naming a lease of another node, or one no table holds, is
   set aside. Of two gangs naming one lease, the one a rank of which holds it is kept (tie: the lower gang id).
3. A set-aside lease's memory is not handed to anyone: the keeper's entry, unknown to the table, is dropped
   (manager.py `load`), as after a crash between the keeper and the table.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.gpu_manager.gang import Gang


@dataclass(frozen=True)
class BadRow:
    """A row to set aside: which table (`lease` or `gang`), its key there, why, and the row as it was (JSON)."""

    kind: str
    key: str
    reason: str
    row: str

    @classmethod
    def of(cls, kind: str, key: Any, reason: str, row: Mapping[Any, Any]) -> BadRow:
        return cls(kind, str(key), reason, json.dumps(dict(row), default=repr, sort_keys=True))


@dataclass(frozen=True)
class LeaseRow:
    """What a gang check needs of a lease row named by a gang: its node and its owner (None: a row set aside)."""

    node: str
    owner: str | None


def gang_defects(gangs: Iterable[Gang], leases: Mapping[str, LeaseRow], node: str) -> dict[str, str]:
    """gang id -> why it cannot be loaded (invariant 2), for the gangs of `node`; `leases` are the rows (any node, any
    state, or set aside) of every lease id the gangs name."""
    out: dict[str, str] = {}
    for gang in gangs:
        unknown = sorted(i for i in gang.epochs if i not in leases)
        foreign = sorted(f"{i} (node {leases[i].node})" for i in gang.epochs if i in leases and leases[i].node != node)
        if unknown:
            out[gang.gang_id] = f"it names leases {unknown} that no table of node {node} holds"
        elif foreign:
            out[gang.gang_id] = f"it names leases of another node: {', '.join(foreign)}"
    claimed: dict[str, Gang] = {}
    for gang in sorted((g for g in gangs if g.gang_id not in out), key=lambda g: g.gang_id):
        rivals = {claimed[i].gang_id: (i, claimed[i]) for i in gang.epochs if i in claimed}
        losers = [(i, other) for i, other in rivals.values() if _rightful(other, gang, leases[i].owner) is gang]
        if len(losers) < len(rivals):  # an earlier gang keeps one of its leases: this one goes
            lease_id, keeper = next((i, o) for i, o in rivals.values() if (i, o) not in losers)
            out[gang.gang_id] = f"lease {lease_id} is gang {keeper.gang_id}'s"
            continue
        for lease_id, other in losers:
            out[other.gang_id] = f"lease {lease_id} is gang {gang.gang_id}'s"
            claimed = {i: g for i, g in claimed.items() if g is not other}
        claimed.update(dict.fromkeys(gang.epochs, gang))
    return out


def _rightful(first: Gang, second: Gang, owner: str | None) -> Gang:
    """Which of two gangs naming one lease keeps it: the one a rank of which holds it, else the first."""
    if first.rank_of(owner or "") is None and second.rank_of(owner or "") is not None:
        return second
    return first
