"""When a degraded engine is regrouped (services/controller/operations.py `regroup_refusal`, regroup_driver.py
`due`): pure logic over a view filled as etcd's watch fills it; the pass itself over a real etcd."""

from __future__ import annotations

import json

from libs.common.events import EngineInfo, EngineRole, IncidentReason, LeaseInfo, LeaseState, Tag
from libs.common.store import Store
from services.controller.incident import IncidentRecord, incident_id_for
from services.controller.operations import regroup_refusal
from services.controller.regroup_driver import RegroupDriver, due
from services.controller.view import ClusterView

NODE = "n1"


def _view(*, spec_tp: int = 2, engine_tp: int = 1, backup: bool = True, healthy: tuple[bool, ...] = (True, True)
          ) -> ClusterView:
    view = ClusterView()
    view.apply("put", f"nodes/{NODE}", json.dumps({"node": NODE, "agent_pid": 1}).encode())
    for gpu, ok in enumerate(healthy):
        view.apply("put", f"gpus/{NODE}/{gpu}", json.dumps({"healthy": ok, "total_bytes": 1 << 30}).encode())
    view.apply("put", "specs/batched", json.dumps({"engine_class": "batched", "model": "m", "tp": spec_tp}).encode())
    engine = EngineInfo(engine_id="e1", node=NODE, model="m", engine_class="batched", role=EngineRole.ACTIVE,
                        state="ready", tp=engine_tp)
    view.apply("put", f"engines/{NODE}/e1", engine.model_dump_json().encode())
    leases = [("w", "weights", Tag.WEIGHTS, False)] + ([("b", "kv_backup", Tag.OTHER, True)] if backup else [])
    for lease_id, name, tag, host in leases:
        info = LeaseInfo(id=lease_id, node=NODE, gpu=0, size=1 << 20, chunk_size=1 << 20, tag=tag, name=name,
                         owner="e1", engine_class="batched", epoch=1, state=LeaseState.ACTIVE, created_at=0.0,
                         last_seen=0.0, host=host)
        view.apply("put", f"allocations/{NODE}/{lease_id}", info.model_dump_json().encode())
    return view


def test_only_a_degraded_engine_with_a_backup_and_the_gpus_for_a_whole_group_is_regrouped() -> None:
    assert regroup_refusal(_view(), "e1") is None
    assert "not a degraded engine" in (regroup_refusal(_view(spec_tp=1), "e1") or "")
    assert "not a degraded engine" in (regroup_refusal(_view(engine_tp=2), "e1") or "")
    assert "on 1 of its 2 ranks" in (regroup_refusal(_view(spec_tp=3, engine_tp=2, healthy=(True,) * 3), "e1") or "")
    assert "keeps no KV backup" in (regroup_refusal(_view(backup=False), "e1") or "")
    assert "a whole group needs 2" in (regroup_refusal(_view(healthy=(True, False)), "e1") or "")
    assert regroup_refusal(_view(), "nobody") is None  # start_on_purpose answers an unknown engine (404)


def test_an_engine_is_due_once_regroupable_for_the_whole_wait_without_a_break() -> None:
    since: dict[str, float] = {}
    assert due(["a"], since, 10.0, 5.0) == [] and since == {"a": 10.0}
    assert due(["a", "b"], since, 14.0, 5.0) == []
    assert due(["a", "b"], since, 15.0, 5.0) == ["a"]
    assert due(["b"], since, 16.0, 5.0) == [] and since == {"b": 14.0}  # a's break forgets it
    assert due(["a", "b"], since, 19.0, 5.0) == ["b"] and since["a"] == 19.0  # a starts its wait again
    assert due([], since, 20.0, 0.0) == [] and since == {}


async def test_the_pass_starts_one_regroup_incident_in_etcd_once_the_wait_is_over(store: Store) -> None:
    """RegroupDriver over a real etcd: nothing before `regroup_after_s`, then one `regroup` incident for the
    engine's generation, created once (a second pass finds it there: no second incident)."""
    view = _view()
    driver = RegroupDriver(store, view, after_s=5.0)
    await driver.tick(100.0)
    assert await store.get_prefix("incidents/") == {}
    await driver.tick(105.0)
    (raw,) = (await store.get_prefix("incidents/")).values()
    rec = IncidentRecord.model_validate_json(raw)
    assert (rec.engine_id, rec.reason, rec.id) == ("e1", IncidentReason.REGROUP, incident_id_for("e1", 0, IncidentReason.REGROUP))
    await driver.tick(110.0)
    await driver.tick(115.0)  # the view has not seen the incident: start_on_purpose's create refuses the second
    assert len(await store.get_prefix("incidents/")) == 1
