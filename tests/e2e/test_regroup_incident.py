"""Back to a whole group once the GPU is healthy again (issue 22 part 6; docs/multi_gpu.md): the whole stack (nats,
etcd, gpu_manager, agent, controller, dc_manager, router; real processes) on a node of two simulated GPUs, a TP=2
batched engine with its KV backed up to host (and TP=3 on three GPUs). GPU 1 fails under 4 greedy streams: one
engine on GPU 0 (two ranks on GPUs 0 and 2) continues every sequence from the ranks' backups (a degraded engine).
GPU 1 is marked healthy again and the operator asks for a regroup (`holdfast engine regroup`: `POST
/v1/engines/{id}/regroup`): a `regroup` incident routes the degraded engine out, the dc_manager places a whole group
on GPUs 0..tp-1, freezes the engine's KV backup alone (the degraded group's gang degraded) and spawns the group
(`Spawn(backup_of)`, `Spawn(degrade_gang)`); the agent stops the engine first, the group's rank 0 takes the backups
over and every rank restores its kv heads of every sequence. Greedy streams running through either change end with
the uninterrupted run's tokens, none lost or twice, no prompt prefilled again, through one routed model throughout."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from libs.common.events import MarkGpu, MarkGpuReply
from tests.e2e.test_tp_incident import started
from tests.e2e.test_tp_kv_backup_incident import STREAMS, BackedGroupScenario, Outcome, streams_through_a_loss

REGROUP_TOKENS = 640
LOSS_TOKENS = 512  # the streams outlive the backup's rounds at three ranks on a loaded machine (CI failed at 256)


def continued(out: Outcome) -> bool:
    """Every stream ended with the uninterrupted run's tokens: none lost, none twice, the same tokens."""
    assert [r.error for r in out.results] == [None] * STREAMS and all(r.done for r in out.results)
    return [r.tokens for r in out.results] == [r.tokens for r in out.control]


class ThreeRanks(BackedGroupScenario):
    """TP=3 on three GPUs, 3 kv heads (tiny3): the degraded group is two ranks, on GPUs 0 and 2."""

    gpus = 3
    tp = 3


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("scenario", "size"), [(BackedGroupScenario, "tiny"), (ThreeRanks, "tiny3")],
                         ids=["tp2-1-2", "tp3-2-3"])
async def test_a_degraded_engine_is_regrouped_into_a_whole_group_and_every_stream_continues(
        tmp_path: Path, scenario: type[BackedGroupScenario], size: str) -> None:
    sc = scenario(size=size, backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    tp = sc.tp
    try:
        await started(sc)
        group = await sc.wait_serving(standbys=0, timeout=180)
        assert sc.bus is not None and sc.stack is not None
        bus, node, stack = sc.bus, sc.stack.config.node, sc.stack
        marked: list[MarkGpuReply] = []

        async def lose() -> None:
            marked.append(await bus.request(node, MarkGpu(gpu=1, detail="xid 79 (test)"), MarkGpuReply, timeout=10))
        lost = await streams_through_a_loss(sc, group, lose, max_tokens=LOSS_TOKENS)
        assert continued(lost) and marked[0].engines == [group.engine_id]  # the group on GPU 1: one engine faulted
        degraded = lost.successor
        assert [i.id for i in lost.incidents] == [lost.record["id"]] and lost.record["engine_id"] == group.engine_id
        assert lost.record["fallback"] and lost.record["state"] == "resolved"  # one incident, its memory lost
        assert degraded.tp == tp - 1 and degraded.gpu == 0  # one engine on GPU 0; two ranks on GPUs 0 and 2
        assert lost.health["degraded"]["from_ranks"] == tp and lost.health["engine"]["recomputed_tokens"] == 0
        assert {i.gpu for i in lost.after if not i.host} == ({0} if tp == 2 else {0, 2})  # only the GPUs left
        admin = {"Authorization": f"Bearer {stack.config.api_token}"}
        async with httpx.AsyncClient(base_url=stack.api_url, headers=admin, timeout=30) as api:
            refused = await asyncio.to_thread(  # the operator's command line; GPU 1 still unhealthy
                subprocess.run, [sys.executable, "-m", "holdfast.main", "engine", "regroup", degraded.engine_id,
                                 "--api-url", stack.api_url, "--token", stack.config.api_token],
                capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
            assert refused.returncode == 1 and "answered 409" in refused.stdout, refused.stdout + refused.stderr
            assert f"a whole group needs {tp}" in refused.stdout, refused.stdout
            assert (await api.post(f"/v1/engines/{group.engine_id}-gone/regroup")).status_code == 404
            healed = await bus.request(node, MarkGpu(gpu=1, healthy=True, detail="replaced"), MarkGpuReply, timeout=10)
            assert healed.healthy

            async def regroup() -> None:
                asked = await api.post(f"/v1/engines/{degraded.engine_id}/regroup")
                assert asked.status_code == 202, asked.text
                assert asked.json()["reason"] == "regroup"
            # the regroup reaches the engine through the incident pipeline (seconds on a loaded machine): long streams
            out = await streams_through_a_loss(sc, degraded, regroup, max_tokens=REGROUP_TOKENS)
    finally:
        await sc.close()
        await asyncio.to_thread(sc.stop)
    record, successor, health = out.record, out.successor, out.health
    assert continued(out)
    assert record["engine_id"] == degraded.engine_id and record["reason"] == "regroup"
    assert record["fallback"] and record["state"] == "resolved"
    came = "one engine" if tp == 2 else f"{tp - 1} ranks"
    assert f"regrouped from {came} to {tp} ranks: KV of " in record["steps"]["fallback"]["detail"], record["steps"]
    assert successor.tp == tp and len(successor.ranks) == tp and successor.gpu == 0  # a whole group, GPUs 0..tp-1
    regrouped, stats = health["degraded"], health["engine"]
    assert regrouped["from_ranks"] == tp - 1 and regrouped["to_ranks"] == tp and regrouped["restored"] >= 1
    # Every sequence the backups held continues with no prefill. One they did not vouch for (a claimed row whose
    # mirror was still behind when the engine was stopped: docs/kv_backup.md, "Not yet"; seen once under a full CI
    # load, 2026-12-05) is replayed, its context prefilled again, and still ends exact (`continued`).
    assert stats["recomputed_tokens"] == 0 or regrouped["restored"] < STREAMS, (regrouped, stats)
    assert {i.owner for i in out.after} == set(successor.ranks)  # the degraded engine's leases given back too
    assert {i.gpu for i in out.after if not i.host} == set(range(tp))
    print(f"regrouped to {tp} ranks: {record['steps']['fallback']}")  # noqa: T201
