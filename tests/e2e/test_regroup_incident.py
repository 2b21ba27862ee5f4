"""Back to a whole group once the GPU is healthy again (issue 22 part 6; docs/multi_gpu.md): the whole stack (nats,
etcd, gpu_manager, agent, controller, dc_manager, router; real processes) on a node of two simulated GPUs, a TP=2
batched engine with its KV backed up to host. GPU 1 fails: one engine on GPU 0 continues every sequence from the
ranks' backups (a degraded engine, test_tp_degraded_incident.py). GPU 1 is marked healthy again and the operator
asks for a regroup (`POST /v1/engines/{id}/regroup`): a `regroup` incident routes the degraded engine out, the
dc_manager places a whole group on GPUs 0 and 1, freezes the engine's KV backup alone and spawns the group
(`Spawn(backup_of)`); the agent stops the engine first, the group's rank 0 takes the backup over and every rank
restores its kv heads of every sequence. Greedy streams running through the regroup end with the uninterrupted
run's tokens, none lost or twice, no prompt prefilled again, through one routed model throughout."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from libs.common.events import MarkGpu, MarkGpuReply
from tests.e2e.test_tp_incident import started, wait_successor
from tests.e2e.test_tp_kv_backup_incident import STREAMS, BackedGroupScenario, streams_through_a_loss


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_a_degraded_engine_is_regrouped_into_a_whole_group_and_every_stream_continues(tmp_path: Path) -> None:
    sc = BackedGroupScenario(size="tiny", backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    try:
        await started(sc)
        group = await sc.wait_serving(standbys=0, timeout=180)
        assert sc.bus is not None and sc.stack is not None
        bus, node, stack = sc.bus, sc.stack.config.node, sc.stack
        seen = len(sc.events)
        await bus.request(node, MarkGpu(gpu=1, detail="xid 79 (test)"), MarkGpuReply, timeout=10)
        await sc.wait_event("incident.resolved", 180, after=seen)
        degraded = await wait_successor(sc, group)
        assert degraded.tp == 1 and degraded.gpu == 0
        admin = {"Authorization": f"Bearer {stack.config.api_token}"}
        async with httpx.AsyncClient(base_url=stack.api_url, headers=admin, timeout=30) as api:
            refused = await api.post(f"/v1/engines/{degraded.engine_id}/regroup")  # GPU 1 still unhealthy
            assert refused.status_code == 409 and "a whole group needs 2" in refused.text, refused.text
            assert (await api.post(f"/v1/engines/{group.engine_id}-gone/regroup")).status_code == 404
            healed = await bus.request(node, MarkGpu(gpu=1, healthy=True, detail="replaced"), MarkGpuReply, timeout=10)
            assert healed.healthy

            async def regroup() -> None:
                asked = await api.post(f"/v1/engines/{degraded.engine_id}/regroup")
                assert asked.status_code == 202, asked.text
                assert asked.json()["reason"] == "regroup"
            out = await streams_through_a_loss(sc, degraded, regroup)
    finally:
        await sc.close()
        await asyncio.to_thread(sc.stop)
    results, control, record, successor, health = out.results, out.control, out.record, out.successor, out.health
    assert [r.error for r in results] == [None] * STREAMS and all(r.done for r in results)
    assert [r.tokens for r in results] == [r.tokens for r in control]  # none lost, none twice, the same tokens
    assert record["engine_id"] == degraded.engine_id and record["reason"] == "regroup"
    assert record["fallback"] and record["state"] == "resolved"
    assert "regrouped from one engine to 2 ranks: KV of " in record["steps"]["fallback"]["detail"], record["steps"]
    assert successor.tp == 2 and len(successor.ranks) == 2 and successor.gpu == 0  # a whole group, GPUs 0 and 1
    regrouped, stats = health["degraded"], health["engine"]
    assert regrouped["from_ranks"] == 1 and regrouped["to_ranks"] == 2 and regrouped["restored"] >= 1
    assert stats["recomputed_tokens"] == 0  # no request prefilled again
    assert {i.owner for i in out.after} == set(successor.ranks)  # the degraded engine's backup given back too
    assert {i.gpu for i in out.after if not i.host} == {0, 1}
    print(f"regrouped: {record['steps']['fallback']}")  # noqa: T201
