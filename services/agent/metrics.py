"""Agent metrics in Prometheus form (`GET /metrics` on `metrics_port`).

Engines by role and state, and the crash-loop backoff, are read from the agent's records at scrape time.
Starts, detections and takeovers are counted by `MeteredAgent` where they happen: every engine start goes
through `start_engine`, and every detection (`FaultDetected`) and finished takeover (`EngineReattached`)
through `publish`, so the counts equal what the control plane was told.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.common.events import EngineReattached, EngineRole, Event, FaultDetected
from services.agent.engines import EngineRecord, State
from services.agent.supervisor import Agent

# A takeover by a warm standby takes milliseconds; by a cold start, the engine's load (minutes for large weights).
TAKEOVER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.starts = Counter("holdfast_agent_engine_starts", "Engine processes started, by role", ["role"],
                              registry=self.registry)
        self.detections = Counter("holdfast_agent_detections", "Engine failures detected and published, by kind "
                                  "and role", ["kind", "role"], registry=self.registry)
        self.takeovers = Counter("holdfast_agent_takeovers", "Takeovers finished, by successor (standby or cold)",
                                 ["successor"], registry=self.registry)
        self.takeover_seconds = Histogram("holdfast_agent_takeover_seconds", "Takeover command to successor ready",
                                          ["successor"], buckets=TAKEOVER_BUCKETS_S, registry=self.registry)

    def watch(self, agent: Agent) -> None:
        self.registry.register(RecordsCollector(agent))

    def record(self, payload: Event) -> None:
        if isinstance(payload, FaultDetected):
            self.detections.labels(str(payload.kind), str(payload.role)).inc()
        elif isinstance(payload, EngineReattached):
            successor = "standby" if payload.used_standby else "cold"
            self.takeovers.labels(successor).inc()
            total_ms = payload.timings_ms.get("total_ms")
            if total_ms is not None:
                self.takeover_seconds.labels(successor).observe(total_ms / 1000.0)


class RecordsCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[GaugeMetricFamily]:
        engines = GaugeMetricFamily("holdfast_agent_engines", "Engines on this node, by role and state",
                                    labels=["role", "state"])
        count = {(role, state): 0 for role in EngineRole for state in State}
        for rec in list(self.agent.engines.values()):
            count[(rec.role, rec.state)] += 1
        for (role, state), n in count.items():
            engines.add_metric([str(role), str(state)], n)
        yield engines
        failing = GaugeMetricFamily("holdfast_agent_crash_loop_failures",
                                    "Failures in a row of an engine spec (its restarts back off meanwhile)",
                                    labels=["spec"])
        for key, b in list(self.agent.backoffs.by_key.items()):
            failing.add_metric([key], b.failures)
        yield failing


class MeteredAgent(Agent):
    """The agent, counting its starts, detections and takeovers into `metrics`."""

    def __init__(self, *args: Any, metrics: AgentMetrics, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.metrics = metrics
        metrics.watch(self)

    def start_engine(self, key: str, role: EngineRole, **kw: Any) -> EngineRecord:
        rec = super().start_engine(key, role, **kw)
        self.metrics.starts.labels(str(role)).inc()
        return rec

    def publish(self, payload: Event) -> None:
        self.metrics.record(payload)
        super().publish(payload)
