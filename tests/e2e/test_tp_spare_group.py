"""A spare group (EngineSpec.spares on a TP spec; docs/multi_gpu.md "Spares") through the whole stack: a TP=2
batched engine with its KV backed up to host (`--kv-backup`) on GPUs 0-1 of a node of four simulated GPUs, its spec
a spare group on GPUs 2-3 (every rank's shard loaded and cache leased while it stands by). GPU 1 is marked failed
under greedy streams: rank 1's weights and cache are lost, one fault, one incident, its memory lost. The
dc_manager's fallback freezes the gang degraded (every rank's backup) and, finding the spare group, spawns it in the
group's place (`Spawn(degrade_gang, spare)`): the agent assigns it the backups (`degraded`), its ranks take them over
as a degraded group's do and restore every sequence into the caches they hold. A whole group serves on at once,
nothing loaded in the outage: every stream ends with the uninterrupted run's tokens, none lost or twice, no prompt
prefilled again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.e2e.test_kv_backup_gpu_fault import wait_spare
from tests.e2e.test_tp_incident import started
from tests.e2e.test_tp_kv_backup_incident import STREAMS, BackedGroupScenario, gpu_failed


class GroupWithSpare(BackedGroupScenario):
    gpus = 4
    spares = 1
    spec_gpus = (0, 2)  # the groups' bases


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_spare_group_takes_a_groups_kv_backups_over_when_a_ranks_gpu_fails(tmp_path: Path) -> None:
    sc = GroupWithSpare(size="tiny", backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    try:
        faults = await started(sc)
        group = await sc.wait_serving(standbys=0, timeout=180)
        spare = await wait_spare(sc)
        assert (group.gpu, group.tp, spare.gpu, spare.tp) == (0, 2, 2, 2)  # GPUs 0-1, the spare's 2-3
        held = [i for i in (await sc.leases()).leases if i.owner in spare.ranks]
        assert sorted(i.gpu for i in held) == [2, 2, 3, 3] and not any(i.host for i in held)  # shards and caches
        marked, out = await gpu_failed(sc, group, 1)
    finally:
        await sc.close()
        await asyncio.to_thread(sc.stop)
    results, control, record, successor, health = out.results, out.control, out.record, out.successor, out.health
    assert marked.engines == [group.engine_id] and {f.group or f.engine_id for f in faults} == {group.engine_id}
    assert [r.error for r in results] == [None] * STREAMS and all(r.done for r in results)
    assert [r.tokens for r in results] == [r.tokens for r in control]  # none lost, none twice, the same tokens
    assert [i.id for i in out.incidents] == [record["id"]] and record["state"] == "resolved" and record["fallback"]
    assert successor.engine_id == spare.engine_id and (successor.gpu, successor.tp) == (2, 2)  # the spare group
    assert successor.gang == group.gang  # the gang keeps its id: the next incident freezes it
    assert successor.successor_of == group.engine_id
    fallback = record["steps"]["fallback"]["detail"]
    assert fallback.startswith("weights of a spare, loaded before the fault"), fallback
    assert "; a whole group again on 2 ranks: KV of " in fallback, fallback
    degraded, stats = health["degraded"], health["engine"]
    assert health["memory"]["source"] == "degraded" and degraded["from_ranks"] == 2 and degraded["restored"] >= 1
    assert stats["recomputed_tokens"] == 0  # no request prefilled again
    assert {i.owner for i in out.after} == set(spare.ranks) and {i.gpu for i in out.after} == {2, 3}
    print(f"TP=2 on a spare group: {record['steps']['fallback']}")  # noqa: T201
