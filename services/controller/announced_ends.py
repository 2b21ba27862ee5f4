"""`AnnouncedEnds`: which ended incidents have had their end published, from the leader's ledgers. Pure: no I/O.

An ended record is written once, marked `end_unannounced` by the transition that ends it (incident.py, invariant 2),
and its end (`incident.resolved` / `incident.failed`) is published after (endings.py). That the end went out is not
written back into each record: that was a second put of the whole record per incident, and its watch event in every
controller's view, ~15% of the control plane's CPU in a burst (docs/controlplane.md). The leader records it per
published batch instead: one small key, `announced/<ledger id>`, naming the batch's incidents (`Ledger`), written
behind. An end counts as announced when a ledger names it, or (a record of an earlier version) its mark is off.

A ledger names only records already in etcd (it is written after their ends were published, which is after their
writes were confirmed), and it is deleted once none of them is left (retention deleted them all): it is then spent.

Invariants:
1. An incident is announced here iff a ledger held names it.
2. A ledger is spent iff no incident it names still has a record: every one was seen deleted, or was absent from a
   snapshot (`sweep`). A ledger learnt before or after the records it names (separate watches) ends the same.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from pydantic import BaseModel, ConfigDict


class Ledger(BaseModel):
    """The value of `announced/<ledger id>`: incidents whose end is published."""

    model_config = ConfigDict(extra="ignore")
    incidents: list[str]


class AnnouncedEnds:
    def __init__(self) -> None:
        self._left: dict[str, set[str]] = {}  # ledger id -> the incidents it names whose record is not yet deleted
        self._named_in: dict[str, list[str]] = {}  # incident id -> the ledgers naming it
        self.spent: dict[str, float] = {}  # ledger id -> since when it names no record (to delete; oldest first)

    def __contains__(self, inc_id: object) -> bool:
        return inc_id in self._named_in

    def __len__(self) -> int:
        return len(self._left)

    def add(self, ledger_id: str, inc_ids: Iterable[str], now: float) -> None:
        """A ledger put (the leader's, or a snapshot's)."""
        self.remove(ledger_id)
        left = self._left[ledger_id] = set(inc_ids)
        for inc_id in left:
            self._named_in.setdefault(inc_id, []).append(ledger_id)
        if not left:
            self.spent[ledger_id] = now

    def remove(self, ledger_id: str) -> None:
        """A ledger deleted."""
        self.spent.pop(ledger_id, None)
        for inc_id in self._left.pop(ledger_id, ()):
            self._unname(inc_id, ledger_id)

    def deleted(self, inc_id: str, now: float) -> None:
        """An incident's record deleted (retention): the ledgers naming it have one record less."""
        for ledger_id in self._named_in.pop(inc_id, ()):
            left = self._left.get(ledger_id)
            if left is not None:
                left.discard(inc_id)
                if not left:
                    self.spent[ledger_id] = now

    def sweep(self, records: Container[str], now: float) -> None:
        """A snapshot's records are all there are: whatever a ledger names beyond them is deleted."""
        for ledger_id, left in self._left.items():
            for inc_id in [inc_id for inc_id in left if inc_id not in records]:
                left.discard(inc_id)
                self._unname(inc_id, ledger_id)
            if not left and ledger_id not in self.spent:
                self.spent[ledger_id] = now

    def _unname(self, inc_id: str, ledger_id: str) -> None:
        names = self._named_in.get(inc_id)
        if names is not None and ledger_id in names:
            names.remove(ledger_id)
            if not names:
                del self._named_in[inc_id]
