"""Which GPUs the cluster view offers for a node (pure: `ClusterView.apply`, no etcd). The node's own list
(`NodeInfo.gpus`, from its agent) is trusted over `gpus/` records: a record left by a node that came back with
fewer GPUs (probe finding 5) is not offered, so a drain's cold start goes to the GPU the node has."""

from __future__ import annotations

import json

from libs.common.cluster_view import ClusterView
from libs.common.events import GpuRecord
from services.dc_manager.placement import Action, place

M = 1 << 20


def node_back_with_one_gpu() -> ClusterView:
    """node-2 came back with GPU 0 (8 MiB) only; its old GPU 1 (32 MiB, healthy) is still in etcd."""
    view = ClusterView()
    view.apply("put", "nodes/node-2", json.dumps({"node": "node-2", "agent_pid": 1, "started_at": 0.0,
                                                  "gpus": [0]}).encode())
    for gpu, size in ((0, 8 * M), (1, 32 * M)):
        rec = GpuRecord(node="node-2", gpu=gpu, uuid=f"SIM-node-2-{gpu}", total_bytes=size)
        view.apply("put", f"gpus/node-2/{gpu}", rec.model_dump_json().encode())
    return view


def test_a_leftover_record_of_a_gpu_the_node_does_not_list_is_not_offered() -> None:
    view = node_back_with_one_gpu()
    assert view.node_gpus("node-2") == [0]
    assert [(s.node, s.gpu) for s in view.gpu_slots()] == [("node-2", 0)]
    assert view.gpu_slot("node-2", 1) is None


def test_a_cold_start_goes_to_the_gpu_the_node_has_not_the_leftover_with_more_room() -> None:
    view = node_back_with_one_gpu()
    p = place("node-1", 0, memory_lost=True, needed_bytes=4 * M, slots=view.gpu_slots(), alive=set(view.nodes))
    assert (p.action, p.node, p.gpu) == (Action.COLD_START, "node-2", 0)


def test_a_node_without_its_own_list_has_the_gpus_its_records_name() -> None:
    view = node_back_with_one_gpu()
    view.apply("put", "nodes/node-2", json.dumps({"node": "node-2", "gpus": []}).encode())
    assert view.node_gpus("node-2") == [0, 1]
    view.apply("delete", "nodes/node-2", None)
    assert view.node_gpus("node-2") == [0, 1]  # its records still name them; gpu_slots lists present nodes only
    assert view.gpu_slots() == []


def test_a_node_is_at_its_count_of_a_spec_only_with_as_many_actives_and_at_least_one() -> None:
    """ClusterView.nodes_at_count: what an agent refuses a cold start for (admit_active); a spec that wants none
    there takes one back (services/agent/commands.py)."""
    import json as _json

    from libs.common.cluster_view import ClusterView as View

    view = View()
    for node in ("a", "b", "c"):
        view.apply("put", f"nodes/{node}", _json.dumps({"node": node}).encode())
    for node, replicas in (("a", 1), ("b", 2), ("c", 0)):
        view.apply("put", f"agents/{node}/specs/k", _json.dumps({"model": "m", "replicas": replicas}).encode())
    for eid, node, state in (("e1", "a", "ready"), ("e2", "b", "ready"), ("e3", "c", "failed")):
        view.apply("put", f"engines/{node}/{eid}", _json.dumps({
            "engine_id": eid, "node": node, "model": "m", "engine_class": "x", "role": "active", "state": state,
            "spec_key": "k"}).encode())
    assert view.nodes_at_count("k") == {"a"}  # b runs 1 of 2; c wants none and runs none: it takes one
    assert view.nodes_at_count("other") == set()
    assert view.nodes_at_count("k", replacing="e1") == set()  # a's one active is the failed one being replaced
    view.apply("delete", "nodes/a", None)  # gone: its records name no count anyone would refuse for
    assert view.nodes_at_count("k") == set()
