"""Spares (EngineSpec.spares), the agent's pure side and the cluster view's: a spare is a standby of its own kind,
counted apart from the spec's standbys, started on a healthy GPU of the spec where none of its actives runs (or
nowhere), never picked to take an engine's memory over nor offered a shadow; the spare the dc_manager names is
assigned only while it is a warm spare of the spec on a healthy GPU. An engine whose memory a GPU fault lost keeps
its slot for the control plane's fallback successor for `fallback_wait_s`, then is replaced by the agent itself."""

from __future__ import annotations

import json

import pytest

from libs.common.cluster_view import ClusterView
from libs.common.errors import Conflict
from libs.common.events import EngineRole, EngineSpec
from libs.common.gpu import GpuEntry
from services.agent import gpus, supervision
from services.agent.engines import EngineRecord, State

GPUS = [GpuEntry(0, "GPU-0"), GpuEntry(1, "GPU-1"), GpuEntry(2, "GPU-2")]
KEY = "m_batched_1"


def spec(**kw: object) -> EngineSpec:
    fields: dict[str, object] = {"replicas": 1, "standbys": 0, "spares": 1, "gpus": [0, 1], **kw}
    return EngineSpec(engine_class="batched", model="m", command=["serve"], **fields)  # type: ignore[arg-type]


def rec(eid: str, role: EngineRole, state: State, gpu: int, *, spare: bool = False, age: float = 0.0) -> EngineRecord:
    return EngineRecord(engine_id=eid, model="m", engine_class="batched", role=role, state=state, gpu=gpu,
                        spec_key=KEY, spare=spare, spawned_mono=age)


def test_a_spare_is_counted_apart_from_the_specs_standbys() -> None:
    active = rec("a", EngineRole.ACTIVE, State.READY, 0)
    p = supervision.plan({KEY: spec(standbys=1)}, [active], 10.0, 60.0)
    assert p.start == [(KEY, EngineRole.STANDBY)] and p.spares == [KEY]
    spare = rec("s", EngineRole.STANDBY, State.STANDBY, 1, spare=True)
    p = supervision.plan({KEY: spec(standbys=1)}, [active, spare], 10.0, 60.0)
    assert p.start == [(KEY, EngineRole.STANDBY)] and p.spares == []  # a spare is no standby
    standby = rec("b", EngineRole.STANDBY, State.STANDBY, 0)
    p = supervision.plan({KEY: spec(standbys=1)}, [active, standby], 10.0, 60.0)
    assert p.start == [] and p.spares == [KEY]  # nor a standby a spare
    extra = rec("s2", EngineRole.STANDBY, State.STARTING, 2, spare=True, age=5.0)
    p = supervision.plan({KEY: spec()}, [active, spare, extra], 10.0, 60.0)
    assert p.stop == ["s2"] and p.spares == []  # one too many: the newest goes


def test_only_a_class_that_builds_them_runs_spares_and_a_groups_spare_is_a_group_on_gpus_of_its_own() -> None:
    assert supervision.spares_of(spec()) == 1 and supervision.spares_of(spec(tp=2, gpus=[0, 2])) == 1
    assert supervision.spares_of(spec().model_copy(update={"engine_class": "reference"})) == 0
    four = [*GPUS, GpuEntry(3, "GPU-3")]
    group = spec(tp=2, gpus=[0, 2])
    active = EngineRecord(engine_id="g", model="m", engine_class="batched", role=EngineRole.ACTIVE, state=State.READY,
                          gpu=0, tp=2, spec_key=KEY)
    assert gpus.pick_gpu(group, KEY, EngineRole.STANDBY, four, [active], {}, spare=True).index == 2  # GPUs 2-3
    with pytest.raises(Conflict):  # GPU 3 failed: no whole span of two left beside the group
        gpus.pick_gpu(group, KEY, EngineRole.STANDBY, four, [active], {3: "xid"}, spare=True)
    spare = EngineRecord(engine_id="s", model="m", engine_class="batched", role=EngineRole.STANDBY,
                         state=State.STANDBY, gpu=2, tp=2, spec_key=KEY, spare=True)
    assert supervision.pick_spare([spare], KEY, "s", {}, tp=2) is spare
    assert supervision.pick_spare([spare], KEY, "s", {3: "xid"}, tp=2) is None  # a rank's GPU failed since
    assert supervision.pick_spare([spare], KEY, "s", {}) is None  # not of a single engine's shape


def test_a_spare_starts_where_no_active_of_its_spec_runs_or_nowhere() -> None:
    active = rec("a", EngineRole.ACTIVE, State.READY, 0)
    assert gpus.pick_gpu(spec(), KEY, EngineRole.STANDBY, GPUS, [active], {}, spare=True).index == 1
    # GPU 1 unhealthy: no GPU of the spec is left for it (never beside the engine it stands by for)
    with pytest.raises(Conflict, match="a spare needs one of its own"):
        gpus.pick_gpu(spec(), KEY, EngineRole.STANDBY, GPUS, [active], {1: "xid 79"}, spare=True)
    moved = rec("b", EngineRole.ACTIVE, State.READY, 1)  # GPU 0 failed and the engine serves on GPU 1 now
    with pytest.raises(Conflict):
        gpus.pick_gpu(spec(), KEY, EngineRole.STANDBY, GPUS, [moved], {0: "xid 79"}, spare=True)
    wide = spec().model_copy(update={"gpus": [0, 1, 2], "spares": 2})
    one = rec("s", EngineRole.STANDBY, State.STANDBY, 1, spare=True)
    assert gpus.pick_gpu(wide, KEY, EngineRole.STANDBY, GPUS, [active, one], {}, spare=True).index == 2
    # an ordinary standby of the spec still goes beside its active: a spare is not counted as one
    assert gpus.pick_gpu(spec(), KEY, EngineRole.STANDBY, GPUS, [active, one], {}).index == 0


def test_a_spare_never_takes_an_engines_memory_over_nor_shadows_it() -> None:
    active = rec("a", EngineRole.ACTIVE, State.READY, 0)
    spare = rec("s", EngineRole.STANDBY, State.STANDBY, 0, spare=True)
    spare.can_shadow, spare.linked = True, True
    assert supervision.pick_standby([active, spare], "m", gpu=0) is None
    assert supervision.starting_standby([active, rec("t", EngineRole.STANDBY, State.STARTING, 0, spare=True)], "m",
                                        gpu=0) is None
    assert supervision.shadow_plan([active, spare]).offer == []


def test_the_named_spare_is_assigned_only_while_it_is_a_warm_spare_on_a_healthy_gpu() -> None:
    spare = rec("s", EngineRole.STANDBY, State.STANDBY, 1, spare=True)
    assert supervision.pick_spare([spare], KEY, "s", {}) is spare
    assert supervision.pick_spare([spare], KEY, "s", {1: "xid"}) is None  # its GPU failed since
    assert supervision.pick_spare([spare], "other_batched_1", "s", {}) is None  # another spec's
    assert supervision.pick_spare([spare], KEY, "x", {}) is None
    assert supervision.pick_spare([rec("s", EngineRole.STANDBY, State.STARTING, 1, spare=True)], KEY, "s", {}) is None
    assert supervision.pick_spare([rec("s", EngineRole.STANDBY, State.STANDBY, 1)], KEY, "s", {}) is None  # a standby


def test_an_engine_whose_gpu_failed_keeps_its_slot_for_the_fallback_for_a_while() -> None:
    lost = rec("a", EngineRole.ACTIVE, State.FAILED, 0)
    lost.memory_lost, lost.failed_mono, lost.fallback_until = True, 100.0, 105.0
    p = supervision.plan({KEY: spec(spares=0)}, [lost], 101.0, 60.0)
    assert p.start == [] and p.retire == []  # the fallback's successor (a spare, its KV backup) comes for the slot
    p = supervision.plan({KEY: spec(spares=0)}, [lost], 105.5, 60.0)
    assert p.retire == ["a"] and p.start == [(KEY, EngineRole.ACTIVE)]  # none came: the agent replaces it
    lost.fallback_until = None  # lost otherwise (its incident ended): replaced at once, as before
    p = supervision.plan({KEY: spec(spares=0)}, [lost], 101.0, 60.0)
    assert p.retire == ["a"] and p.start == [(KEY, EngineRole.ACTIVE)]


def _engine(eid: str, gpu: int, *, spare: bool, state: str = "standby", version: str = "1") -> bytes:
    return json.dumps({"engine_id": eid, "node": "n1", "model": "m", "engine_class": "batched", "role": "standby",
                       "state": state, "gpu": gpu, "spare": spare, "version": version,
                       "started_at": 10.0 + gpu}).encode()


def test_the_view_finds_a_spare_on_a_healthy_gpu_of_the_node() -> None:
    view = ClusterView()
    view.apply("put", "nodes/n1", json.dumps({"node": "n1", "gpus": [0, 1, 2]}).encode())
    view.apply("put", "engines/n1/sb", _engine("sb", 0, spare=False))  # an ordinary standby: not a spare
    assert view.spare_on("n1", "m", "batched", "1") is None
    view.apply("put", "engines/n1/s2", _engine("s2", 2, spare=True))
    view.apply("put", "engines/n1/s1", _engine("s1", 1, spare=True))
    assert view.spare_on("n1", "m", "batched", "1").engine_id == "s1"  # type: ignore[union-attr]  # the oldest
    assert view.spare_on("n1", "m", "batched", "1", {1}).engine_id == "s2"  # type: ignore[union-attr]
    assert view.spare_on("n1", "m", "batched", "2") is None and view.spare_on("n2", "m", "batched", "1") is None
    assert view.spare_on("n1", "m", "reference", "1") is None
    view.apply("put", "gpus/n1/2", json.dumps({"node": "n1", "gpu": 2, "healthy": False}).encode())
    assert view.spare_on("n1", "m", "batched", "1", {1}) is None  # the view's health counts too
    view.apply("delete", "nodes/n1", None)  # its node gone: its agent could assign nothing
    assert view.spare_on("n1", "m", "batched", "1") is None
    view.apply("put", "nodes/n1", json.dumps({"node": "n1", "gpus": [0, 1, 2]}).encode())
    view.apply("put", "engines/n1/s1", _engine("s1", 1, spare=False, state="ready"))  # assigned: serves
    assert view.sole_standby("m", "n1", None) is not None and view.spare_on("n1", "m", "batched", "1") is None


def test_a_hot_upgrade_moves_the_spares_with_the_last_replica() -> None:
    old, new = spec(spares=1), spec(spares=0).model_copy(update={"version": "2", "replicas": 0})
    old2, new2 = supervision.move_replica(old, new)
    assert (old2.replicas, old2.spares) == (0, 0) and (new2.replicas, new2.spares) == (1, 1)
    two = spec(spares=1).model_copy(update={"replicas": 2})
    old3, new3 = supervision.move_replica(two, new)
    assert (old3.replicas, old3.spares) == (1, 1) and (new3.replicas, new3.spares) == (1, 0)  # the old still serves


def test_a_stranger_spare_is_adopted_into_its_specs_spares_not_its_standbys() -> None:
    active = rec("a", EngineRole.ACTIVE, State.READY, 0)
    specs = {KEY: spec(standbys=0, spares=1)}
    assert supervision.admit_stranger(specs, [active], KEY, EngineRole.STANDBY, spare=True) is None
    assert "wants 0 standby" in (supervision.admit_stranger(specs, [active], KEY, EngineRole.STANDBY) or "")
    spare = rec("s", EngineRole.STANDBY, State.STANDBY, 1, spare=True)
    assert "wants 1 spare" in (supervision.admit_stranger(specs, [active, spare], KEY, EngineRole.STANDBY,
                                                          spare=True) or "")  # one too many
