"""Controller metrics in Prometheus form (`GET /metrics`).

Counters and histograms are recorded by the incident driver of this process; gauges about memory are
computed from the view at scrape time (bytes held per lease state and per owner), so every controller,
leader or not, reports the same cluster state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.common.events import LeaseState
from services.controller.incident import IncidentRecord
from services.controller.view import ClusterView

# Recovery steps run from about a millisecond (a warm reattach) to minutes (a cold start).
BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ViewCollector(Collector):
    def __init__(self, view: ClusterView, is_leader: Callable[[], bool]) -> None:
        self.view = view
        self.is_leader = is_leader

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_state = GaugeMetricFamily("holdfast_lease_bytes", "Bytes held by leases, per lease state", labels=["state"])
        sums = {s: 0 for s in LeaseState}
        per_owner: dict[tuple[str, str], int] = {}
        for lease in list(self.view.leases.values()):
            sums[lease.state] += lease.size
            if lease.state is not LeaseState.RECLAIMED:
                per_owner[(lease.owner, lease.state)] = per_owner.get((lease.owner, lease.state), 0) + lease.size
        for state, total in sums.items():
            by_state.add_metric([str(state)], total)
        yield by_state
        owner = GaugeMetricFamily("holdfast_lease_owner_bytes", "Bytes held per owner engine and lease state",
                                  labels=["owner", "state"])
        for (o, s), total in per_owner.items():
            owner.add_metric([o, str(s)], total)
        yield owner
        open_inc = GaugeMetricFamily("holdfast_incidents_open", "Incidents not yet resolved or failed")
        open_inc.add_metric([], len(self.view.open_by_engine))
        yield open_inc
        for name, doc, value in (("holdfast_nodes", "Nodes alive (agent key present)", len(self.view.nodes)),
                                 ("holdfast_engines", "Engines recorded", len(self.view.engines)),
                                 ("holdfast_controller_leader", "1 when this controller is the leader",
                                  1 if self.is_leader() else 0)):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g


class ControllerMetrics:
    def __init__(self, view: ClusterView, is_leader: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        self.incidents = Counter("holdfast_incidents", "Incidents closed, by kind, reason and outcome",
                                 ["kind", "reason", "outcome"], registry=self.registry)
        self.opened = Counter("holdfast_incidents_opened", "Incidents opened, by kind and reason",
                              ["kind", "reason"], registry=self.registry)
        self.step_seconds = Histogram("holdfast_incident_step_seconds", "Duration of each recovery step",
                                      ["step"], buckets=BUCKETS_S, registry=self.registry)
        self.total_seconds = Histogram("holdfast_incident_total_seconds", "Engine death to successor routed in",
                                       ["reason", "fallback"], buckets=BUCKETS_S, registry=self.registry)
        self.registry.register(ViewCollector(view, is_leader))

        # Labelled children by label values: `labels()` validates and locks on every call (hundreds a second).
        self._children: dict[tuple[object, ...], Any] = {}

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def record_opened(self, rec: IncidentRecord) -> None:
        self._child(self.opened, str(rec.kind or "none"), str(rec.reason)).inc()

    def record_closed(self, rec: IncidentRecord) -> None:
        outcome = "fallback" if rec.fallback and rec.state == "resolved" else str(rec.state)
        self._child(self.incidents, str(rec.kind or "none"), str(rec.reason), outcome).inc()
        for step, s in rec.steps.items():
            if s.ended_at is not None:  # duration_ms, without the property's rounding and second lookup
                self._child(self.step_seconds, str(step)).observe(s.ended_at - s.started_at)
        total = rec.total_ms()
        if total is not None:
            self._child(self.total_seconds, str(rec.reason), str(rec.fallback).lower()).observe(total / 1000.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
