"""Which standby an incident's route-out names as the likely successor (EndpointRemoved.successor_id): the one
the node's agent will assign (services/agent/supervision.py `pick_standby`), from the controller's view alone."""

from __future__ import annotations

import json

from libs.common.cluster_view import ClusterView
from services.controller.incident import IncidentRecord
from services.controller.routes import likely_successor


def _put(view: ClusterView, eid: str, *, node: str = "n1", state: str = "standby", shadows: str | None = None,
         endpoint: str | None = "http://127.0.0.1:9", model: str = "m", version: str = "1", tp: int = 1,
         gpu: int = 0) -> None:
    view.apply("put", f"engines/{node}/{eid}", json.dumps(
        {"engine_id": eid, "node": node, "model": model, "engine_class": "c", "role": "standby", "state": state,
         "shadows": shadows, "endpoint": endpoint, "version": version, "tp": tp, "gpu": gpu}).encode())


def _rec(**kw: object) -> IncidentRecord:
    return IncidentRecord(id="i1", engine_id="e1", model="m", node="n1", **kw)  # type: ignore[arg-type]


def _named(view: ClusterView, rec: IncidentRecord) -> str | None:
    hit = likely_successor(view, rec)
    return hit.engine_id if hit is not None else None


def test_the_shadow_of_the_failed_engine_is_named_before_any_other_standby() -> None:
    view = ClusterView()
    _put(view, "other")
    _put(view, "sb", shadows="e1")
    _put(view, "elsewhere", node="n2", shadows="e1")  # another node's standby cannot take the memory over
    assert _named(view, _rec()) == "sb"


def test_without_a_shadow_only_a_sole_standby_is_named_because_the_agent_picks_the_oldest() -> None:
    view = ClusterView()
    _put(view, "only")
    _put(view, "busy", state="ready")  # serving already: not a standby the agent could assign
    _put(view, "other-model", model="x")
    _put(view, "group", tp=2)
    assert _named(view, _rec()) == "only"
    _put(view, "second")
    assert _named(view, _rec()) is None  # two to pick from: the agent's choice is its own
    view.apply("delete", "engines/n1/second", None)
    _put(view, "only", state="ready")  # promoted: no standby waits any more
    assert _named(view, _rec()) is None and view.standbys_on == {"n1": {"other-model", "group"}}


def test_a_named_standby_is_named_and_nothing_without_an_endpoint_a_version_or_for_a_group() -> None:
    view = ClusterView()
    _put(view, "sb", shadows="e1")
    _put(view, "named")
    assert _named(view, _rec(successor_hint="named")) == "named"
    assert _named(view, _rec(successor_hint="missing")) is None
    assert _named(view, _rec(version="2")) is None  # a hot upgrade's successor runs the new version
    assert _named(view, _rec(gang="g1")) is None  # a group's successor is a group
    _put(view, "sb", shadows="e1", endpoint=None)  # an engine that does not say where it listens while standing by
    assert _named(view, _rec()) is None


def test_only_a_standby_on_the_failed_engines_gpu_is_named() -> None:
    """The agent assigns a standby on the predecessor's GPU only (its leases are that device's memory)."""
    view = ClusterView()
    _put(view, "on-1", gpu=1)
    assert _named(view, _rec(gpu=1)) == "on-1"
    assert _named(view, _rec(gpu=0)) is None  # the sole standby is on another GPU: the agent will not assign it
    assert _named(view, _rec(gpu=0, successor_hint="on-1")) is None
    _put(view, "on-0", gpu=0)
    assert _named(view, _rec(gpu=0)) == "on-0" and _named(view, _rec(gpu=1)) == "on-1"  # one each: sole per GPU
