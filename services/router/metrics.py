"""Router metrics in Prometheus form (`GET /metrics` on `metrics_port`).

Requests by outcome, replays and requests in flight are the relay's own counters (`Relay.stats`, also in
`/stats`), read at scrape time. Time to first token is observed by `MeteredRelay`, the relay with one clock
around each request: from the call to its first token line (a request that fails before any token, or whose
first line is the final one, observes nothing).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.router.relay import ClientRequest, Relay, Stats

# From a warm engine's few milliseconds to a request held through a recovery (hold_timeout_s: 10 s by default).
TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
OUTCOMES = ("completed", "failed", "client_errors", "cancelled")  # fields of Stats; `rejected` is a part of failed


class StatsCollector(Collector):
    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.stats
        done = CounterMetricFamily("holdfast_router_requests", "Requests ended, by outcome", labels=["outcome"])
        for outcome in OUTCOMES:
            done.add_metric([outcome], getattr(s, outcome))
        yield done
        for name, doc, value in (
                ("holdfast_router_requests_received", "Requests received", s.requests),
                ("holdfast_router_rejected", "Requests refused before streaming (503: held too long, queue full)",
                 s.rejected),
                ("holdfast_router_replays", "Requests resumed on another engine", s.replayed)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        g = GaugeMetricFamily("holdfast_router_in_flight", "Requests being relayed (held ones included)")
        g.add_metric([], s.in_flight)
        yield g


class MeteredRelay(Relay):
    """The relay, observing each request's time to its first token."""

    def __init__(self, *args: Any, ttft: Histogram, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.ttft = ttft

    async def run(self, req: ClientRequest, request_id: str | None = None) -> AsyncGenerator[dict[str, Any], None]:
        t0 = time.perf_counter()
        first = True
        async with aclosing(super().run(req, request_id)) as lines:
            async for item in lines:
                if first and not item.get("done"):
                    self.ttft.observe(time.perf_counter() - t0)
                    first = False
                yield item


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("holdfast_router_time_to_first_token_seconds",
                              "Request received to its first token sent, holds and replays included",
                              buckets=TTFT_BUCKETS_S, registry=self.registry)

    def watch(self, stats: Stats) -> None:
        self.registry.register(StatsCollector(stats))
