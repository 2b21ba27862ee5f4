"""`LostNodes`: the engines of a node that is gone, whose deaths no message will report.

Every other fault is published by the failed engine's own agent. A whole node lost (its power, kernel or network)
takes its agent with it: its engines' records, endpoints and leases stayed in etcd as if they served, no incident
opened, a model whose only replica was there answered 502 until the node came back, and a warm standby elsewhere
waited unused (probe of 2026-12-07). The agent keeps `nodes/<node>` alive in etcd (a lease of a few seconds), so
the leader sees the node go; this says which of its engines to declare lost, and when. Pure: no I/O; the deadline
pass (deadline_pass.py) asks it each tick, probes the suspects' endpoints and opens their incidents.

Invariants:
1. A suspect is an active engine (starting or ready) with an endpoint, recorded on a node the view has not listed
   for `after_s` (counted from when this leader first saw it missing), whose generation no incident took up yet
   (open, ended, or replaced since: `handled`). One still starting with no endpoint is left to its node's spec.
2. A suspect is declared lost only when it does not answer as itself at its endpoint (engine_probe.py: no
   connection, no answer in time, or another process there), and its node is still gone and its record unchanged
   once the probe is back (`answered`'s `alive` says otherwise): a node whose agent alone died, or one cut from etcd,
   still serves, and is left to its agent when it returns. One that answered is a suspect again only `after_s`
   later; one being probed is not asked again meanwhile.
3. Each engine generation is declared lost once per leader's term; the fault made for it is the one its agent
   would have sent (`node_lost`: its memory went with the node), so its incident has the id that the agent's
   late report of the same death finds when the node comes back (one incident per failed generation).
4. A lost engine whose generation another engine replaced (`ghosts`) is recorded failed, once: its record outlives
   it until its node comes back, and long after the incident's own record (retention), a later leader would
   otherwise declare it lost again and start one more replica.
5. When the node of an engine declared lost comes back and another engine replaced it (`returned`), it is stopped
   there, once (before its record was marked, or after): it may have lived through it (a
   frozen or cut-off node), unrouted, holding its memory and its node's count of that spec, which then refused the
   next recovery (probe of 2026-12-07). A stop is one fewer of its spec on that node: its replica runs elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from libs.common.events import EngineInfo, EngineRole, Envelope, FaultDetected, FaultKind

LIVE_STATES = frozenset({"starting", "ready"})


@dataclass
class LostNodes:
    after_s: float  # a node absent this long: its engines are suspects (0: never)
    gone_since: dict[str, float] = field(default_factory=dict)  # node -> when first seen missing (with engines)
    asked_at: dict[tuple[str, int], float] = field(default_factory=dict)  # (engine, generation) -> last probed
    declared: set[tuple[str, int]] = field(default_factory=set)  # invariant 3
    probing: set[tuple[str, int]] = field(default_factory=set)  # asked, no answer yet (invariant 2)
    marked: set[tuple[str, int]] = field(default_factory=set)  # recorded failed (invariant 4)
    stopped: set[tuple[str, int]] = field(default_factory=set)  # stopped once its node was back (invariant 5)

    def suspects(self, now: float, present: Iterable[str], engines: Iterable[EngineInfo],
                 handled: Callable[[EngineInfo], bool]) -> list[EngineInfo]:
        """The engines to probe now (invariant 1); marks them asked."""
        if self.after_s <= 0:
            return []
        listed = set(present)
        active = _gone_actives(listed, engines)
        missing = {e.node for e in active}
        keys = {(e.engine_id, e.generation) for e in active}
        for key in [k for k in self.asked_at if k not in keys]:
            del self.asked_at[key]  # back, replaced, or its record gone: nothing to remember
        for node in list(self.gone_since):
            if node not in missing:
                del self.gone_since[node]  # back, or nothing of it left to declare
        out = []
        for e in active:
            since = self.gone_since.setdefault(e.node, now)
            key = (e.engine_id, e.generation)
            if now - since < self.after_s or not e.endpoint or key in self.declared or key in self.probing \
                    or handled(e):
                continue
            if now - self.asked_at.get(key, -float("inf")) < self.after_s:
                continue  # being probed, or answered lately (invariant 2)
            self.asked_at[key] = now
            self.probing.add(key)
            out.append(e)
        return out

    def ghosts(self, present: Iterable[str], engines: Iterable[EngineInfo],
               replaced: Callable[[EngineInfo], bool]) -> list[EngineInfo]:
        """Active engines of gone nodes whose generation another engine replaced, not marked yet (invariant 4);
        marks them."""
        out = []
        for e in _gone_actives(set(present), engines):
            key = (e.engine_id, e.generation)
            if key not in self.marked and replaced(e):
                self.marked.add(key)
                out.append(e)
        return out

    def returned(self, present: Iterable[str], recorded: Callable[[str], EngineInfo | None],
                 replaced: Callable[[EngineInfo], bool]) -> list[EngineInfo]:
        """The engines declared lost in this term, replaced since, still recorded (`recorded(engine_id)`: its
        record), whose node is back: each to be stopped there, once (invariant 5). Only the engines this term
        declared or marked are looked at, not every record."""
        listed = set(present)
        out = []
        for key in (self.declared | self.marked) - self.stopped:
            e = recorded(key[0])
            if e is not None and e.generation == key[1] and e.node in listed and replaced(e):
                self.stopped.add(key)
                out.append(e)
        return out

    def answered(self, e: EngineInfo, alive: bool) -> bool:
        """The probe's outcome; True when `e` is declared lost now (invariant 3)."""
        key = (e.engine_id, e.generation)
        self.probing.discard(key)
        if alive or key in self.declared:
            return False
        self.declared.add(key)
        self.asked_at.pop(key, None)
        return True


def _gone_actives(present: set[str], engines: Iterable[EngineInfo]) -> list[EngineInfo]:
    return [e for e in engines if e.role is EngineRole.ACTIVE and e.state in LIVE_STATES and e.node not in present]


def lost_fault(e: EngineInfo, gone_for_s: float, source: str) -> Envelope:
    """The fault an engine of a lost node gets (invariant 3), as its agent's would come: from its node."""
    fault = FaultDetected(engine_id=e.engine_id, model=e.model, engine_class=e.engine_class, generation=e.generation,
                          pid=e.pid, kind=FaultKind.NODE_LOST, gpu=e.gpu, gpu_uuid=e.gpu_uuid, died_at=time.time(),
                          role=e.role, node=e.node, gang=e.gang,
                          detail=f"node {e.node} gone for {gone_for_s:.1f} s and its engine does not answer")
    return Envelope(type=fault.type, source=source, node=e.node, data=fault)
