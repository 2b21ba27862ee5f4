"""The chaos run's invariants that are sampled while it runs (pure logic: no I/O here; the run feeds samples in).

1. replicas: at no sample do more engines serve a model than its spec's `replicas` (an engine serves when its
   record says active and ready and its process is alive and not stopped; a dead or SIGSTOPped one cannot
   answer, so a stale record of it is not a second server); same for the router's endpoints of live engines.
2. incidents resolve once: every incident seen (in etcd, sampled often enough that the controller's retention,
   >= 120 s, cannot delete one unseen) ends resolved or failed, and none is seen open again after it ended
   nor ends both ways. A terminal event published twice for one incident with one outcome (a new leader
   finishing what the old one had already announced) is at-least-once delivery: counted, not a violation.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

TERMINAL = ("resolved", "failed")


@dataclass
class ReplicaSample:
    at: float
    model: str
    serving: list[str]  # engine ids
    endpoints: list[str]


def excess(at: float, model: str, replicas: int, serving: list[str], endpoints: list[str]) -> ReplicaSample | None:
    """A sample that breaks invariant 1, or None."""
    if len(serving) > replicas or len(endpoints) > replicas:
        return ReplicaSample(at, model, sorted(serving), sorted(endpoints))
    return None


@dataclass
class IncidentTracker:
    """Invariant 2, from snapshots of incidents/ and the terminal events heard."""

    states: dict[str, str] = field(default_factory=dict)  # last state seen per incident
    kinds: dict[str, str] = field(default_factory=dict)
    reopened: list[str] = field(default_factory=list)
    outcomes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # from events
    terminal_events: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # envelope ids
    heard_at: dict[str, float] = field(default_factory=dict)  # when an incident's first terminal event was heard

    def snapshot(self, records: list[dict[str, Any]], taken_at: float = float("inf")) -> None:
        """Records read from etcd by a read that began at `taken_at` (the clock `heard` is given): an incident
        whose end was heard after the read began may be read open (the read saw etcd before the end): not a
        reopening; one heard ended before the read began and read open again is."""
        for rec in records:
            inc = str(rec.get("id") or rec.get("incident_id"))
            state = str(rec.get("state", "")).lower()
            before = self.states.get(inc)
            if before in TERMINAL and state not in TERMINAL:
                if self.heard_at.get(inc, float("-inf")) >= taken_at:
                    continue  # a read older than the end it is compared with
                self.reopened.append(inc)
            if before not in TERMINAL or state in TERMINAL:
                self.states[inc] = state
            self.kinds.setdefault(inc, str(rec.get("kind") or rec.get("reason") or ""))

    def heard(self, incident_id: str, outcome: str, envelope_id: str, at: float = float("-inf")) -> None:
        self.heard_at.setdefault(incident_id, at)
        self.outcomes[incident_id].add(outcome)
        self.terminal_events[incident_id].add(envelope_id)
        self.states.setdefault(incident_id, outcome)  # ended before any snapshot saw it

    def unresolved(self) -> list[str]:
        return sorted(i for i, s in self.states.items() if s not in TERMINAL)

    def failed(self) -> list[str]:
        return sorted(i for i, s in self.states.items() if s == "failed")

    def ended_both_ways(self) -> list[str]:
        return sorted(i for i, o in self.outcomes.items() if len(o) > 1)

    def duplicate_terminal_events(self) -> int:
        return sum(len(ids) - 1 for ids in self.terminal_events.values() if len(ids) > 1)
