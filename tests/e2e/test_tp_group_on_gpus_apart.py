"""A whole group on GPUs that are not consecutive (issue 22 part 1; docs/multi_gpu.md): the whole stack (nats, etcd,
gpu_manager, agent, controller, dc_manager, router; real processes) on a node of four simulated GPUs, a TP=3 batched
engine on GPUs 0..2 with its KV backed up to host, the spec's default `degrade` (fewer ranks only when no whole group
fits). GPU 1 fails under 4 greedy streams: no three consecutive GPUs are left, but three healthy ones are (0, 2 and
3), so the dc_manager's fallback places a whole cold group there (`Placement.rank_gpus`: the spawn's spec names
them) rather than degrading to two ranks. Every stream ends with the uninterrupted run's tokens (the router replays
them into the new group), none lost or twice; the group's leases are on GPUs 0, 2 and 3 only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_regroup_incident import ThreeRanks, continued
from tests.e2e.test_tp_kv_backup_incident import through_a_gpu_fault


class FourGpus(ThreeRanks):
    gpus = 4


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_group_whose_gpu_failed_is_started_whole_on_the_healthy_gpus_left_though_not_consecutive(
        tmp_path: Path) -> None:
    sc = FourGpus(size="tiny3", backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    group, _, marked, out = await through_a_gpu_fault(sc, 1)
    assert group.gpus == [0, 1, 2] and marked.engines == [group.engine_id]
    assert continued(out)  # none lost, none twice, the same tokens
    record, successor = out.record, out.successor
    assert record["fallback"] and record["state"] == "resolved" and len(out.incidents) == 1
    assert successor.tp == 3 and successor.gpus == [0, 2, 3] and successor.rank_gpus == [0, 2, 3]
    assert "degraded" not in out.health  # a whole group, not fewer ranks
    assert {i.gpu for i in out.after if not i.host} == {0, 2, 3}
    assert {i.owner for i in out.after} == set(successor.ranks)
    print(f"TP=3 whole again on GPUs 0, 2, 3: {record['steps']['fallback']}")  # noqa: T201
