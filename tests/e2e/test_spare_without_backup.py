"""A spare without a KV backup (the whole stack, real processes, two simulated GPUs): a single batched engine on GPU
0 keeps no backup, its spec a spare on GPU 1 (its own weights and cache leased at its start). GPU 0 is marked failed
under 4 greedy streams: the incident's fallback has nothing to continue, and the dc_manager's cold start names the
spare (`Spawn(spare)`), which the agent assigns with no predecessor instead of starting a process: it serves afresh
at once, and the router replays every stream into it (each prompt prefilled again: what a backup would save). Every
stream ends with the uninterrupted run's tokens, none lost or twice."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from libs.common.events import MarkGpu, MarkGpuReply
from tests.e2e.test_kv_backup_gpu_fault import wait_spare
from tests.e2e.test_tp_incident import BatchedGroupScenario, started, wait_successor

PROMPTS = [f"a spare stands by on another GPU {'s' * (2 * i)}" for i in range(4)]


class SingleWithSpare(BatchedGroupScenario):
    tp = 1
    spares = 1
    spec_gpus = (0, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_spare_serves_afresh_when_the_engine_whose_gpu_failed_kept_no_backup(tmp_path: Path) -> None:
    sc = SingleWithSpare(size="tiny", backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    try:
        await started(sc)
        engine = await sc.wait_serving(standbys=0, timeout=180)
        spare = await wait_spare(sc)
        assert (engine.gpu, spare.gpu) == (0, 1)
        assert sc.bus is not None and sc.stack is not None and sc.store is not None
        async with httpx.AsyncClient() as client:
            control = await asyncio.gather(*(sc.generate(client, p, max_tokens=96) for p in PROMPTS))
            seen = len(sc.events)
            streams = [asyncio.create_task(sc.generate(client, p, max_tokens=96)) for p in PROMPTS]
            await sc._until_tokens(streams, want=4 * len(PROMPTS))
            marked = await sc.bus.request(sc.stack.config.node, MarkGpu(gpu=0, detail="xid 79 (test)"), MarkGpuReply,
                                          timeout=10)
            results = await asyncio.gather(*streams)
            resolved = await sc.wait_event("incident.resolved", 180, after=seen)
            successor = await wait_successor(sc, engine)
            health = await sc.engine_health(successor.endpoint or "")
        raw = await sc.store.get(f"incidents/{resolved.incident_id}")  # type: ignore[attr-defined]
    finally:
        await sc.close()
        await asyncio.to_thread(sc.stop)
    assert marked.engines == [engine.engine_id]
    assert [r.error for r in results] == [None] * len(PROMPTS) and all(r.done for r in results)
    assert [r.tokens for r in results] == [r.tokens for r in control]  # none lost, none twice, the same tokens
    assert raw is not None
    record = json.loads(raw)
    assert record["fallback"] and record["state"] == "resolved"
    assert successor.engine_id == spare.engine_id and successor.gpu == 1 and not successor.spare
    assert record["steps"]["fallback"]["detail"].startswith("weights of a spare, loaded before the fault")
    assert health["memory"]["source"] == "spare" and "kv_backup" not in health.get("recovery", {})
    assert health["engine"]["recomputed_tokens"] > 0  # every replayed prompt prefilled again
