"""A tensor-parallel batched group's KV restored from its ranks' host backups (real gpu_manager, real processes):
TP=2 with `--kv-backup`, 4 greedy streams in flight and vouched for by a backup round; every rank's KV lease
reclaimed by force (the group's GPU memory declared lost: each rank exits as its lease goes) and rank 0 SIGKILLed;
the gang, whole without its caches (gpu_manager gang.py invariant 9), frozen and taken over by a new group without
the weights file, each rank restoring its cache from its own backup. Every stream, resumed as the router resumes it,
ends with its uninterrupted tokens, no prompt prefilled again. The host test runs on two simulated GPUs;
test_tp_gang_gpu.py runs the same round on cuda-backend leases, both ranks on the one GPU."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import (
    FreezeGang,
    FreezeGangReply,
    ListLeases,
    ListLeasesReply,
    Reclaim,
    ReclaimReply,
    Tag,
)
from tests.engine.conftest import tiny_weights  # noqa: F401 - fixture
from tests.engine.test_tp import two_gpus  # noqa: F401 - fixture
from tests.engine_batched import test_failover
from tests.engine_batched.test_failover import BatchedEngine, alone, resume, streams_started
from tests.engine_batched.test_tp_gang import GROUP, STREAMS, successor_group

BACKED = (*GROUP, "--kv-backup", "--kv-backup-lag-ms", "100")


def backed_rows(url: str) -> int:
    return int(httpx.get(url + "/health", timeout=10).json()["kv_backup"]["rows"])


async def streams_backed_up(first: BatchedEngine) -> tuple[dict[int, list[int]], dict[int, list[int]],
                                                          list[threading.Thread]]:
    """Each stream's tokens alone (the expected ones: deterministic mode), then STREAMS streams under way on `first`,
    every one vouched for by a backup round: (expected, the tokens each client sees, their reading threads)."""
    first.wait_ready(180)
    with ThreadPoolExecutor(STREAMS) as ex:  # deterministic mode: together as alone
        expected = dict(enumerate(ex.map(lambda i: alone(first.url, i), range(STREAMS))))
    seen, threads = streams_started(first, STREAMS)
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(backed_rows, first.url) < STREAMS:  # every stream vouched for by a round
        assert time.monotonic() < deadline and all(t.is_alive() for t in threads), "no round backed every stream"
        await asyncio.sleep(0.02)
    return expected, seen, threads


async def restored_from_backups(tmp_path: Path, tiny_weights: Path, env: dict[str, str],  # noqa: F811
                                settings: CommonSettings, bus: Bus, group: tuple[str, ...]) -> None:
    first = BatchedEngine(tmp_path, tiny_weights, "btk-a", env, *group)
    expected, seen, threads = await streams_backed_up(first)
    leases = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
    caches = [lease for lease in leases if lease.owner.startswith("btk-a") and lease.tag is Tag.KV_CACHE]
    assert len(caches) == 2
    await asyncio.gather(*(bus.request(settings.node, Reclaim(lease_id=kv.id, force=True), ReclaimReply)
                           for kv in caches))
    try:
        first.kill()
    except ProcessLookupError:
        pass  # gone already, with its lease
    for t in threads:
        await asyncio.to_thread(t.join, 10)
    assert all(0 < len(s) < len(expected[i]) for i, s in seen.items()), "a stream ended before the loss"
    frozen = await bus.request(settings.node, FreezeGang(gang_id="btk-a"), FreezeGangReply)
    assert sorted(lease.name.split(".")[0] for lease in frozen.leases) == ["kv_backup"] * 2 + ["weights"] * 2
    second = successor_group(tmp_path, tiny_weights, "btk-b", env, "btk-a", frozen, group)
    try:
        info = second.wait_ready(180)
        rec = info["recovery"]
        assert rec["kv_backup"]["source"] == "restored" and rec["kv_backup"]["restored"] == STREAMS
        got = {i: await asyncio.to_thread(resume, second.url, i, list(seen[i])) for i in range(STREAMS)}
        stats = httpx.get(second.url + "/health", timeout=10).json()["engine"]
        assert got == expected  # every stream, token for token, from every rank's restored cache
        assert stats["recomputed_tokens"] == 0
        floor = rec["kv_backup"]["recomputed_tokens"] + stats["claim_extra_tokens"]  # past the durable point only
        assert floor <= stats["prefill_tokens"] <= floor + STREAMS, (stats["prefill_tokens"], floor)
    finally:
        second.child.stop()


@pytest.mark.timeout(300)
async def test_a_groups_lost_caches_are_restored_from_every_ranks_backup(
        tmp_path: Path, tiny_weights: Path, two_gpus: Path, settings_env: dict[str, str],  # noqa: F811
        settings: CommonSettings, bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_failover, "MAX_TOKENS", 2 * test_failover.MAX_TOKENS)  # outlive the first rounds
    await restored_from_backups(tmp_path, tiny_weights, settings_env, settings, bus, BACKED)
