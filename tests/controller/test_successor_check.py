"""A failover's named successor is checked before the incident opens (operations.py `check_successor`): a misspelt
name was accepted (202), and the incident routed a healthy engine out and froze its leases before the node's agent
refused the name. Pure: a view fed as etcd's watch feeds it."""

from __future__ import annotations

import pytest

from libs.common.errors import Conflict, NotFound
from libs.common.events import EngineInfo, EngineRole, engine_record_key
from services.controller.operations import check_successor
from services.controller.view import ClusterView


def _put(view: ClusterView, engine_id: str, role: EngineRole, state: str, *, node: str = "n1", gpu: int = 0,
         model: str = "m", version: str = "1") -> None:
    info = EngineInfo(engine_id=engine_id, node=node, model=model, engine_class="reference", role=role, gpu=gpu,
                      state=state, version=version)
    view.apply("put", engine_record_key(node, engine_id), info.model_dump_json().encode())


def test_only_a_ready_standby_of_the_engines_model_node_and_gpu_may_be_named() -> None:
    view = ClusterView()
    _put(view, "a", EngineRole.ACTIVE, "ready")
    _put(view, "sb", EngineRole.STANDBY, "standby")
    check_successor(view, "a", "sb", None)  # fits: nothing raised
    check_successor(view, "a", "sb", "1")
    with pytest.raises(NotFound):
        check_successor(view, "a", "sb-typo", None)
    _put(view, "busy", EngineRole.ACTIVE, "ready", gpu=1)
    _put(view, "warming", EngineRole.STANDBY, "starting")
    _put(view, "far", EngineRole.STANDBY, "standby", node="n2")
    _put(view, "other", EngineRole.STANDBY, "standby", model="m2")
    _put(view, "gpu1", EngineRole.STANDBY, "standby", gpu=1)
    for name, why in (("a", "itself"), ("busy", "not a ready standby"), ("warming", "not a ready standby"),
                      ("far", "cannot leave its node"), ("other", "serves m2"), ("gpu1", "GPUs [1]")):
        with pytest.raises(Conflict) as e:
            check_successor(view, "a", name, None)
        assert why in str(e.value), (name, str(e.value))
    with pytest.raises(Conflict):
        check_successor(view, "a", "sb", "2")  # an upgrade to version 2 needs a standby of version 2
