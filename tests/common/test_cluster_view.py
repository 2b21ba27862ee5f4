"""The cluster view finds a cold-start spec for an engine class (pure bookkeeping, no I/O)."""

from __future__ import annotations

import json

from libs.common.cluster_view import ClusterView
from libs.common.events import EngineSpec


def _spec(cls: str, model: str) -> bytes:
    return EngineSpec(engine_class=cls, model=model, command=["engine"]).model_dump_json().encode()


def test_the_spec_an_agent_runs_serves_cold_starts_of_its_class_and_model() -> None:
    view = ClusterView()
    assert view.spec_of("reference", "demo") is None
    view.apply("put", "agents/node-1/specs/reference-demo-2", _spec("reference", "demo-2"))
    view.apply("put", "agents/node-1/specs/reference-demo", _spec("reference", "demo"))
    assert view.spec_of("reference", "demo")["model"] == "demo"  # type: ignore[index]
    assert view.spec_of("reference", "demo-2")["model"] == "demo-2"  # type: ignore[index]
    view.apply("put", "specs/reference", _spec("reference", "demo"))
    view.apply("put", "agents/node-1/specs/reference-demo", _spec("reference", "demo").replace(b'"engine"', b'"x"'))
    assert view.spec_of("reference", "demo")["command"] == ["engine"]  # type: ignore[index]  # operator-set first
    view.apply("delete", "agents/node-1/specs/reference-demo", None)
    assert view.spec_of("reference", "demo-2")["model"] == "demo-2"  # type: ignore[index]  # not the operator's
    assert view.spec_of("reference", "other") is None  # never another model's spec
    view.apply("delete", "specs/reference", None)
    view.apply("delete", "agents/node-1/specs/reference-demo-2", None)
    assert view.spec_of("reference", "demo-2") is None


def test_other_agent_keys_are_not_specs() -> None:
    view = ClusterView()
    view.apply("put", "agents/node-1/status", json.dumps({"engine_class": "reference", "model": "m"}).encode())
    assert view.spec_of("reference", "m") is None


def _engine(eid: str, *, shadows: str | None = None, state: str = "standby", node: str = "n1") -> bytes:
    return json.dumps({"engine_id": eid, "node": node, "model": "m", "engine_class": "c", "role": "standby",
                       "state": state, "shadows": shadows}).encode()


def test_the_standby_shadowing_an_engine_is_found_and_forgotten_as_its_record_changes() -> None:
    view = ClusterView()
    view.apply("put", "engines/n1/sb", _engine("sb", shadows="e1"))
    assert view.shadow_of("e1", "n1").engine_id == "sb"  # type: ignore[union-attr]
    assert view.shadow_of("e1", "n2") is None  # another node's standby cannot serve its memory
    view.apply("put", "engines/n1/sb", _engine("sb", shadows="e2"))
    assert view.shadow_of("e1", "n1") is None and view.shadow_of("e2", "n1") is not None
    view.apply("put", "engines/n1/sb", _engine("sb", shadows="e2", state="ready"))  # promoted: serves, shadows none
    assert view.shadow_of("e2", "n1") is None
    view.apply("delete", "engines/n1/sb", None)
    assert view.shadowed_by == {}


def test_an_endpoint_reads_as_its_url_whether_written_as_it_is_or_as_a_json_string() -> None:
    view = ClusterView()
    view.apply("put", "endpoints/m/e1", b"http://127.0.0.1:8001")  # as the controller writes it
    view.apply("put", "endpoints/m/e2", b' "http://127.0.0.1:8002"')
    view.apply("put", "endpoints/m/e3", b"12")  # not a URL, kept as written
    assert view.endpoint_of("e1") == ("m", "http://127.0.0.1:8001")
    assert view.endpoint_of("e2") == ("m", "http://127.0.0.1:8002")
    assert view.endpoint_of("e3") == ("m", "12")
    view.apply("delete", "endpoints/m/e1", None)
    assert view.endpoint_of("e1") is None


def test_an_engine_record_counts_only_under_its_own_nodes_key() -> None:
    view = ClusterView()
    view.apply("put", "engines/n1/e1", _engine("e1", state="ready"))
    # Another node's agent may write engines/n2/ only (etcd RBAC); there it cannot recast n1's engine:
    view.apply("put", "engines/n2/e1", _engine("e1", node="n2", state="failed"))  # an id recorded under n1
    view.apply("put", "engines/n2/x", _engine("e1", node="n1", state="failed"))  # a body naming another id
    view.apply("put", "engines/n2/e9", _engine("e9", node="n1"))  # a body naming another node
    view.apply("delete", "engines/n2/e1", None)
    view.apply("put", "engines/e1", _engine("e1", state="failed"))  # the old layout: no node in the key
    assert set(view.engines) == {"e1"} and view.engines["e1"].state == "ready" and view.engines["e1"].node == "n1"
    assert view.engines_on == {("n1", 0): 1}
    view.apply("delete", "engines/n1/e1", None)
    assert view.engines == {} and view.engines_on == {("n1", 0): 0}
    view.apply("put", "engines/n2/e1", _engine("e1", node="n2"))  # once gone from n1, the id is free again
    assert view.engines["e1"].node == "n2"


def test_the_engines_of_nodes_not_listed_are_found_by_their_node() -> None:
    view = ClusterView()
    view.apply("put", "nodes/n1", b"{}")
    view.apply("put", "engines/n1/a", _engine("a"))
    view.apply("put", "engines/n2/b", _engine("b", node="n2"))
    view.apply("put", "engines/n2/c", _engine("c", node="n2", state="failed"))
    assert sorted(e.engine_id for e in view.engines_off_nodes()) == ["b", "c"]
    view.apply("put", "engines/n2/b", _engine("b", node="n2", state="failed"))  # rewritten: still one record
    view.apply("put", "nodes/n2", b"{}")
    assert view.engines_off_nodes() == []
    view.apply("delete", "nodes/n1", None)
    view.apply("delete", "engines/n2/b", None)
    view.apply("delete", "engines/n2/c", None)
    view.apply("delete", "nodes/n2", None)
    assert [e.engine_id for e in view.engines_off_nodes()] == ["a"] and view.recorded_on == {"n1": {"a"}}
