"""deploy/grafana/holdfast.json: every metric the dashboard's PromQL queries is one a service exports, so a
renamed metric or a typo shows as a failing test, not as an empty panel.

What the services export is read from their own prometheus_client registries, built in process (starting four
services to scrape them costs ~10 s here; the registries are what `/metrics` serves). The collectors that read a
service's tables at scrape time are given empty tables: only the names matter, and a family is yielded even
when it has no samples.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from services.agent.metrics import AgentMetrics, RecordsCollector
from services.controller.metrics import ControllerMetrics
from services.controller.view import ClusterView
from services.gpu_manager.limits import ConnectionCount
from services.gpu_manager.metrics import gpu_manager_registry
from services.router.metrics import RouterMetrics
from services.router.relay import Stats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "holdfast.json"

# The series names a family of each type puts in the exposition (prometheus_client names a counter's family
# without `_total`; `_created` is left out: nobody graphs it).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}

# PromQL words in an identifier's place that are not metrics: aggregations and functions are followed by `(`
# and skipped as such; these are the ones that need not be.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}
# Parts of an expression that hold label names, label values or durations, never a metric: `{...}`,
# `by (...)`-like groupings, `[...]` ranges and string literals.
NOT_METRICS = re.compile(r'"(?:[^"\\]|\\.)*"|\{[^}]*\}|\[[^\]]*\]'
                         r"|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
IDENT = re.compile(r"(?<![\w.$:])([a-zA-Z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (PromQL, as Grafana stores it)."""
    stripped = NOT_METRICS.sub(" ", expr)
    return {m.group(1) for m in IDENT.finditer(stripped)
            if m.group(2) is None and m.group(1).lower() not in KEYWORDS}


def registries() -> Iterator[CollectorRegistry]:
    yield ControllerMetrics(ClusterView(), lambda: True).registry
    router = RouterMetrics()
    router.watch(Stats())
    yield router.registry
    agent = AgentMetrics()
    no_engines: Any = SimpleNamespace(engines={}, backoffs=SimpleNamespace(by_key={}))
    agent.registry.register(RecordsCollector(no_engines))
    yield agent.registry
    no_leases: Any = SimpleNamespace(records={}, board=None, rejected=0)
    server: Any = SimpleNamespace(accept_trouble=None)
    yield gpu_manager_registry(no_leases, ConnectionCount(1), server, lambda: (0, 0))


def exported() -> set[str]:
    names = set()
    for registry in registries():
        for family in registry.collect():
            names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query, rows' nested panels included."""
    out = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        out += [(panel["title"], t["expr"]) for t in panel.get("targets", [])]
    return out


def unknown_metrics(dashboard: dict[str, Any], known: set[str]) -> list[str]:
    return [f"{title}: {name}" for title, expr in expressions(dashboard)
            for name in sorted(metric_names(expr) - known)]


def test_the_parser_finds_metrics_and_nothing_else() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, step) (rate(a_bucket{step="detect",x=~"b|c"}[$__rate_interval])))'
            ' / on (instance) group_left max(b_total offset 5m) + sum(c:rule) * 1e3 > bool inf')
    assert metric_names(expr) == {"a_bucket", "b_total", "c:rule"}


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = expressions(dashboard)
    assert len(queries) >= 20
    known = exported()
    assert not unknown_metrics(dashboard, known)
    # Each service's metrics are on the dashboard (a registry that failed to build would fail above, not here).
    used = set().union(*(metric_names(e) for _, e in queries))
    for prefix in ("holdfast_incident", "holdfast_lease_bytes", "holdfast_gpu_manager_", "holdfast_agent_",
                   "holdfast_router_"):
        assert any(n.startswith(prefix) for n in used), prefix


def test_a_misspelt_metric_is_reported() -> None:
    dashboard = json.loads(DASHBOARD.read_text().replace("holdfast_router_replays_total",
                                                         "holdfast_router_replay_total"))
    assert unknown_metrics(dashboard, exported()) == ["Replays: holdfast_router_replay_total"]
