"""Which GPU an engine starts on, and GPUs named by UUID or index (pure)."""

from __future__ import annotations

import pytest

from libs.common.errors import Conflict, NotFound
from libs.common.events import EngineRole, EngineSpec
from libs.common.gpu import GpuEntry, resolve_gpu, simulated_gpus
from services.agent.engines import EngineRecord, State
from services.agent.gpus import pick_gpu, spec_gpus

GPUS = [GpuEntry(0, "GPU-aaaa0000-1111"), GpuEntry(1, "GPU-bbbb0000-2222"), GpuEntry(2, "GPU-cccc0000-3333")]
ACTIVE, STANDBY = EngineRole.ACTIVE, EngineRole.STANDBY


def spec(*gpus: int | str, replicas: int = 2) -> EngineSpec:
    return EngineSpec(model="m", command=["x"], gpus=list(gpus), replicas=replicas)


def rec(i: int, gpu: int, role: EngineRole = ACTIVE, key: str = "k", state: State = State.READY) -> EngineRecord:
    return EngineRecord(engine_id=f"e{i}", model="m", engine_class="c", role=role, gpu=gpu, spec_key=key, state=state)


def test_a_gpu_is_named_by_uuid_by_a_unique_uuid_prefix_or_by_index_and_an_unknown_one_is_not_found() -> None:
    assert resolve_gpu("GPU-bbbb0000-2222", GPUS).index == 1
    assert resolve_gpu("GPU-cccc", GPUS).index == 2
    assert resolve_gpu(0, GPUS).index == resolve_gpu("0", GPUS).index == 0
    for bad in ("GPU-dddd", 7, "GPU-"):
        with pytest.raises(NotFound, match="no GPU"):
            resolve_gpu(bad, GPUS)
    assert [g.index for g in spec_gpus(spec("GPU-cccc0000-3333", 2, 0), GPUS)] == [2, 0]


def test_simulated_gpus_take_indexes_or_uuids_and_refuse_a_gpu_listed_twice() -> None:
    assert [(g.index, g.uuid) for g in simulated_gpus(["0", "1"], "n")] == [(0, "SIM-n-0"), (1, "SIM-n-1")]
    assert [(g.index, g.uuid) for g in simulated_gpus(["GPU-x", "GPU-y"], "n")] == [(0, "GPU-x"), (1, "GPU-y")]
    assert [g.index for g in simulated_gpus([], "n")] == [0]
    with pytest.raises(ValueError, match="twice"):
        simulated_gpus(["1", "1"], "n")


def test_active_replicas_go_one_per_gpu_in_the_specs_order_then_double_up() -> None:
    s = spec("GPU-bbbb0000-2222", 0, replicas=3)
    records: list[EngineRecord] = []
    for i in range(3):
        records.append(rec(i, pick_gpu(s, "k", ACTIVE, GPUS, records, {}).index))
    assert [r.gpu for r in records] == [1, 0, 1]


def test_a_standby_goes_to_the_gpu_whose_actives_have_the_fewest_standbys() -> None:
    records = [rec(0, 0), rec(1, 1), rec(2, 0, STANDBY)]
    assert pick_gpu(spec(0, 1), "k", STANDBY, GPUS, records, {}).index == 1


def test_an_unhealthy_gpu_takes_no_engine_and_a_spec_with_only_unhealthy_gpus_is_a_conflict() -> None:
    records = [rec(0, 0, state=State.FAILED)]  # a failed engine does not count
    assert pick_gpu(spec(0, 1), "k", ACTIVE, GPUS, records, {1: "XID 79"}).index == 0
    with pytest.raises(Conflict, match="XID 79"):
        pick_gpu(spec(1), "k", ACTIVE, GPUS, records, {1: "XID 79"})


def test_a_successor_starts_on_its_predecessors_gpu_where_the_memory_is() -> None:
    pred = rec(0, 2)
    assert pick_gpu(spec(0, 1), "k", ACTIVE, GPUS, [pred], {}, replacing=pred).index == 2


def test_a_tensor_parallel_group_starts_only_where_every_gpu_of_its_span_is_present_and_healthy() -> None:
    four = [*GPUS, GpuEntry(3, "GPU-dddd0000-4444")]
    tp2 = EngineSpec(model="m", command=["x"], gpus=[0, 2], tp=2)
    assert pick_gpu(tp2, "k", ACTIVE, four, [], {}).index == 0  # ranks on 0 and 1
    assert pick_gpu(tp2, "k", ACTIVE, four, [], {1: "XID 79"}).index == 2  # 0's span holds the failed GPU 1
    # a group on 0..1 already: the next goes to the base none of whose GPUs runs one
    assert pick_gpu(tp2, "k", ACTIVE, four, [EngineRecord(engine_id="g0", model="m", engine_class="c", role=ACTIVE,
                                                          gpu=0, spec_key="k", state=State.READY, tp=2)], {}).index == 2
    with pytest.raises(Conflict, match="group of 2 GPUs.*1: XID 79.*3: XID 48"):
        pick_gpu(tp2, "k", ACTIVE, four, [], {1: "XID 79", 3: "XID 48"})
    with pytest.raises(Conflict, match="3: not on this node"):  # 2..3 needs a GPU 3 this node lacks
        pick_gpu(EngineSpec(model="m", command=["x"], gpus=[2], tp=2), "k", ACTIVE, GPUS, [], {})


def test_a_group_that_names_its_ranks_gpus_runs_there_or_nowhere_and_counts_on_each() -> None:
    """A degraded group on the GPUs a failed one left (`rank_gpus`: rank r on the r-th, not consecutive)."""
    four = [*GPUS, GpuEntry(3, "GPU-dddd0000-4444")]
    named = EngineSpec(model="m", command=["x"], gpus=[0], tp=3, rank_gpus=[0, "GPU-cccc", 3])
    assert pick_gpu(named, "k", ACTIVE, four, [], {}).index == 0  # rank 0's
    with pytest.raises(Conflict, match="2: XID 79"):
        pick_gpu(named, "k", ACTIVE, four, [], {2: "XID 79"})
    group = EngineRecord(engine_id="g", model="m", engine_class="c", role=ACTIVE, gpu=0, spec_key="k", tp=3,
                         rank_gpus=[0, 2, 3])
    assert group.gpus == [0, 2, 3] and EngineRecord.from_info(group.info()).gpus == [0, 2, 3]  # a restarted agent's
    with pytest.raises(ValueError, match="3 distinct GPUs"):
        EngineSpec(model="m", command=["x"], tp=3, rank_gpus=[0, 2])
