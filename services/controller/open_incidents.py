"""`OpenIncidents`: the leader's working set of incident records, and what is derived from them. Pure: no I/O.

The records are the incident state (`incident.py`); this table only holds the latest one of each open
incident and indexes derived from them, kept in step by `put`, the one way a record enters or leaves it:
- which engines are successors of open incidents (announced by their route-in, not on their own);
- which cold-started engine belongs to which incident in fallback (routed in when it reports ready);
- which incidents this leader closed recently: the view (fed by the watch, behind the write-behind
  records) may still show them open for a moment, and a late redelivery of their fault must not reopen them.

Invariants:
1. Every record held is open (not terminal); a terminal one put is dropped and remembered as closed; an open one
   put is no longer closed (an end whose write did not land, resumed: endings.py).
2. The indexes name exactly the successors (`successor_id`) and the cold engines (`cold_successor_id`, in
   fallback) of the records held.
3. The closed memory is bounded (`closed_kept`): the oldest half goes (those are long since in the view).
"""

from __future__ import annotations

from collections.abc import Iterator

from services.controller.incident import IncidentRecord, IncidentState


class OpenIncidents:
    def __init__(self, closed_kept: int = 100_000) -> None:
        self._records: dict[str, IncidentRecord] = {}
        self._by_successor: dict[str, str] = {}  # successor engine id -> its incident
        self._by_cold: dict[str, str] = {}  # cold-started engine id -> its incident (in fallback)
        self._closed: dict[str, None] = {}  # insertion-ordered: the oldest first
        self._closed_kept = closed_kept

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, inc_id: object) -> bool:
        return inc_id in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._records))

    def get(self, inc_id: str) -> IncidentRecord | None:
        return self._records.get(inc_id)

    def records(self) -> list[IncidentRecord]:
        return list(self._records.values())

    def put(self, rec: IncidentRecord) -> None:
        """The incident's latest record (invariant 1: a terminal one closes it here)."""
        self._unindex(rec.id)
        if rec.terminal:
            self._closed[rec.id] = None
            if len(self._closed) > self._closed_kept:
                for old in list(self._closed)[: self._closed_kept // 2]:
                    del self._closed[old]
            return
        self._records[rec.id] = rec
        if self._closed:
            self._closed.pop(rec.id, None)
        if rec.successor_id:
            self._by_successor[rec.successor_id] = rec.id
        if rec.state is IncidentState.FALLBACK and rec.cold_successor_id:
            self._by_cold[rec.cold_successor_id] = rec.id

    def drop(self, inc_id: str) -> None:
        """Not open here (its record was not found, or was found ended by an earlier leader)."""
        self._unindex(inc_id)

    def closed_here(self, inc_id: str) -> bool:
        return inc_id in self._closed

    def is_successor(self, engine_id: str) -> bool:
        return engine_id in self._by_successor

    def incident_of_cold(self, engine_id: str) -> str | None:
        return self._by_cold.get(engine_id)

    def _unindex(self, inc_id: str) -> None:
        old = self._records.pop(inc_id, None)
        if old is None:
            return
        if old.successor_id and self._by_successor.get(old.successor_id) == inc_id:
            del self._by_successor[old.successor_id]
        if old.cold_successor_id and self._by_cold.get(old.cold_successor_id) == inc_id:
            del self._by_cold[old.cold_successor_id]
