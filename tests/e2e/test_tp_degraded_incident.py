"""Degraded serving through the whole stack (issue 22 part 6; docs/multi_gpu.md): a TP=2 batched engine with its KV
backed up to host (`--kv-backup`) on the node's two simulated GPUs (nats, etcd, gpu_manager, agent, controller,
dc_manager, router; real processes). Greedy streams run through the router; GPU 1 is marked failed (what an NVML XID
does): rank 1's weights and cache are lost, the group gets one fault and one incident, its memory lost. No two
healthy GPUs are left for a successor group, so the dc_manager's fallback freezes the gang degraded (every rank's
backup) and starts one engine on GPU 0, which takes both backups over and restores every sequence from them, each
rank's kv heads into their place. Every stream ends with the uninterrupted run's tokens, none lost or twice, no
prompt prefilled again, through one routed model throughout."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from libs.common.events import MarkGpu, MarkGpuReply
from tests.e2e.test_tp_incident import incidents, started, wait_successor
from tests.e2e.test_tp_kv_backup_incident import MAX_TOKENS, STREAMS, BackedGroupScenario, prompts


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_group_whose_gpu_failed_is_continued_by_one_engine_from_its_ranks_backups(tmp_path: Path) -> None:
    sc = BackedGroupScenario(size="tiny", backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    try:
        faults = await started(sc)
        group = await sc.wait_serving(standbys=0, timeout=180)
        assert sc.bus is not None and sc.stack is not None
        async with httpx.AsyncClient() as client:
            control = await asyncio.gather(*(sc.generate(client, p, max_tokens=MAX_TOKENS) for p in prompts()))
            assert all(r.done and not r.error for r in control)
            seen = len(sc.events)
            streams = [asyncio.create_task(sc.generate(client, p, max_tokens=MAX_TOKENS)) for p in prompts()]
            await sc._until_tokens(streams, want=4 * STREAMS)
            await sc.until_backed_up(group.endpoint or "", rows=STREAMS)  # every stream vouched for by a round
            marked = await sc.bus.request(sc.stack.config.node, MarkGpu(gpu=1, detail="xid 79 (test)"), MarkGpuReply,
                                          timeout=10)
            results = await asyncio.gather(*streams)
            resolved = await sc.wait_event("incident.resolved", 180, after=seen)
            successor = await wait_successor(sc, group)
            health = await sc.engine_health(successor.endpoint or "")
        assert sc.store is not None
        raw = await sc.store.get(f"incidents/{resolved.incident_id}")  # type: ignore[attr-defined]
        assert raw is not None
        record = json.loads(raw)
        after = (await sc.leases()).leases
        incs = await incidents(sc)
    finally:
        await sc.close()
        await asyncio.to_thread(sc.stop)
    assert marked.engines == [group.engine_id]  # the group on GPU 1 (its rank 1): one engine faulted
    assert [r.error for r in results] == [None] * STREAMS and all(r.done for r in results)
    assert [r.tokens for r in results] == [r.tokens for r in control]  # none lost, none twice, the same tokens
    assert faults and {f.group or f.engine_id for f in faults} == {group.engine_id}
    assert [i.id for i in incs] == [record["id"]] and record["engine_id"] == group.engine_id  # one incident
    assert record["fallback"] and record["state"] == "resolved"
    assert successor.tp == 1 and successor.gpu == 0  # one engine, on the GPU left
    degraded, stats = health["degraded"], health["engine"]
    assert health["memory"]["source"] == "degraded" and degraded["from_ranks"] == 2 and degraded["restored"] >= 1
    assert stats["recomputed_tokens"] == 0  # no request prefilled again
    assert stats["prefill_tokens"] == degraded["recomputed_tokens"] + stats["claim_extra_tokens"]
    assert {i.owner for i in after} == {successor.engine_id} and {i.gpu for i in after} == {0}
    print(f"TP=2 degraded to one engine: {record['steps']['fallback']}")  # noqa: T201
