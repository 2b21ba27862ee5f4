"""The whole stack with the batched engine's KV backup to host on (real nats, etcd, gpu_manager on the host backend,
agent with a warm standby, controller, dc_manager, router; real signals): 8 greedy streams through the router; the
active engine's KV lease is reclaimed by force (its GPU memory declared lost) and the engine SIGKILLed. The
controller keeps the incident on the reattach path (the cache's host backup and the weights live), the standby
takes over weights and backup, restores the cache from the backup, and the timeline's reattach row says "KV from
host backup". Every stream ends with the uninterrupted run's tokens, none lost or twice; no request was prefilled
again (only the positions past the backup's durable point were recomputed, and counted)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from bench.load_recovery import LoadScenario, batched_command
from devstack.scenario import MODEL, make_weights
from devstack.stack import Stack, StackConfig
from libs.common.events import EngineSpec, Reclaim, ReclaimReply, Tag

STREAMS = 8
MAX_TOKENS = 96


class BackupScenario(LoadScenario):
    def start(self) -> Stack:
        make_weights(self.size, self.weights)
        command = batched_command(self.weights, self.size, max_num_seqs=self.max_num_seqs, kv_cache_gib=None,
                                  step_tokens=512, prefill_chunk=64) + ["--kv-backup", "--kv-backup-lag-ms", "100"]
        spec = EngineSpec(engine_class="batched", model=MODEL, command=command, replicas=1, standbys=1,
                          cold_start_s=120.0)
        self.stack = Stack(StackConfig.ephemeral(base_dir=self.work_dir / "stack", backend="host",
                                                 engines_file=self.write_specs(spec)))
        self.stack.start(timeout=180)
        return self.stack


def prompts() -> list[str]:
    return [f"stream {i}: the cache is gone, its copy in host memory is not {'y' * i}" for i in range(STREAMS)]


async def lose_kv_memory(sc: BackupScenario) -> str:
    """The active engine's KV lease reclaimed by force, then the engine SIGKILLed (a lost GPU takes its process)."""
    active = await sc.wait_serving(timeout=60)
    leases = [lease for lease in (await sc.leases()).leases if lease.owner == active.engine_id]
    (kv,) = [lease for lease in leases if lease.tag is Tag.KV_CACHE]
    assert any(lease.name == "kv_backup" for lease in leases)
    assert sc.bus is not None and sc.stack is not None
    await sc.bus.request(sc.stack.config.node, Reclaim(lease_id=kv.id, force=True), ReclaimReply, timeout=5)
    sc.kill_engine(active)
    return active.engine_id


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_lost_kv_cache_is_restored_from_its_host_backup_through_the_whole_stack(tmp_path: Path) -> None:
    sc = BackupScenario(size="tiny", backend="host", standbys=1, max_num_seqs=32, kv_cache_gib=None, work_dir=tmp_path)
    await asyncio.to_thread(sc.start)
    try:
        await sc.connect()
        async with httpx.AsyncClient() as client:
            active = await sc.wait_serving(timeout=300)
            control = await asyncio.gather(*(sc.generate(client, p, max_tokens=MAX_TOKENS) for p in prompts()))
            assert all(r.done and not r.error for r in control)
            seen = len(sc.events)
            streams = [asyncio.create_task(sc.generate(client, p, max_tokens=MAX_TOKENS)) for p in prompts()]
            await sc._until_tokens(streams, want=4 * STREAMS)
            await sc.until_backed_up(active.endpoint or "", rows=STREAMS, pid=active.pid, streams=streams)
            lost = await lose_kv_memory(sc)
            results = await asyncio.gather(*streams)
            resolved = await sc.wait_event("incident.resolved", 120, after=seen)
            successor = await sc.wait_serving(standbys=0, timeout=120)
            health = await sc.engine_health(successor.endpoint or "")
        assert sc.store is not None
        raw = await sc.store.get(f"incidents/{resolved.incident_id}")
        assert raw is not None
        record = json.loads(raw)
    finally:
        await sc.close()
        sc.stop()
    assert [r.error for r in results] == [None] * STREAMS and all(r.done for r in results)
    assert [r.tokens for r in results] == [r.tokens for r in control]  # none lost, none twice, the same tokens
    assert record["engine_id"] == lost and not record["fallback"] and record["state"] == "resolved"
    reattach = record["steps"]["reattach"]
    assert reattach["status"] == "done" and reattach["detail"].startswith("KV from host backup: ")
    restore, stats = health["recovery"]["kv_backup"], health["engine"]
    assert restore["source"] == "restored" and restore["restored"] >= 1
    assert stats["recomputed_tokens"] == 0  # no request prefilled again
    assert stats["prefill_tokens"] == restore["recomputed_tokens"] + stats["claim_extra_tokens"]
    print(f"{reattach['detail']}; the clients had seen {stats['claim_past_adopted_tokens']} tokens past the backup "
          f"({stats['claim_extra_tokens']} of them fed, the rest decoded again before the claims)")
