"""Degraded serving through the whole stack (issue 22 part 6; docs/multi_gpu.md): a TP=2 batched engine with its KV
backed up to host (`--kv-backup`) on a node of four simulated GPUs (nats, etcd, gpu_manager, agent, controller,
dc_manager, router; real processes). Greedy streams run through the router; GPU 1 is marked failed (what an NVML XID
does): rank 1's weights and cache are lost, the group gets one fault and one incident, its memory lost. A whole group
would fit on GPUs 2..3, but the spec says `degrade: first`, so the dc_manager's fallback freezes the gang degraded
(every rank's backup) and starts one engine on GPU 0, which takes both backups over and restores every sequence from
them, each rank's kv heads into their place. Every stream ends with the uninterrupted run's tokens, none lost or
twice, no prompt prefilled again, through one routed model throughout. The default (no whole group left, on a node of
two GPUs) is the first half of tests/e2e/test_regroup_incident.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_tp_kv_backup_incident import STREAMS, BackedGroupScenario, through_a_gpu_fault


class DegradeFirst(BackedGroupScenario):
    """Four GPUs, so a whole group fits on 2..3 after GPU 1 fails; the spec degrades first all the same."""

    gpus = 4
    degrade = "first"


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_group_whose_gpu_failed_is_continued_by_one_engine_from_its_ranks_backups(tmp_path: Path) -> None:
    sc = DegradeFirst(size="tiny", backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    group, faults, marked, out = await through_a_gpu_fault(sc, 1)
    assert marked.engines == [group.engine_id]  # the group on GPU 1 (its rank 1): one engine faulted
    results, control, record, successor, health = out.results, out.control, out.record, out.successor, out.health
    assert [r.error for r in results] == [None] * STREAMS and all(r.done for r in results)
    assert [r.tokens for r in results] == [r.tokens for r in control]  # none lost, none twice, the same tokens
    assert faults and {f.group or f.engine_id for f in faults} == {group.engine_id}
    assert [i.id for i in out.incidents] == [record["id"]] and record["engine_id"] == group.engine_id  # one incident
    assert record["fallback"] and record["state"] == "resolved"
    assert "; degraded from 2 ranks to one engine: KV of " in record["steps"]["fallback"]["detail"], record["steps"]
    assert successor.tp == 1 and successor.gpu == 0  # one engine, on the GPU left
    degraded, stats = health["degraded"], health["engine"]
    assert health["memory"]["source"] == "degraded" and degraded["from_ranks"] == 2 and degraded["restored"] >= 1
    assert stats["recomputed_tokens"] == 0  # no request prefilled again
    assert stats["prefill_tokens"] == degraded["recomputed_tokens"] + stats["claim_extra_tokens"]
    assert {i.owner for i in out.after} == {successor.engine_id} and {i.gpu for i in out.after} == {0}
    print(f"TP=2 degraded to one engine: {record['steps']['fallback']}")  # noqa: T201
