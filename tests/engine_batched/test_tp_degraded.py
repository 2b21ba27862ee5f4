"""Degraded tensor parallelism (issue 22 part 6; engines/batched/degrade.py): a TP=2 batched group with `--kv-backup`
on two simulated GPUs (real gpu_manager, real processes) serves 4 greedy streams, each vouched for by a backup
round; GPU 1 is marked failed (rank 1's weights and cache lost: the gang broken) and the group dies. No second GPU
is left for a whole successor group, so one engine on GPU 0 takes the gang's two backups over (the rest of the gang
reclaimed in the same commit), loads the whole model cold and restores every sequence's KV from both backups, each
rank's kv heads into their place. Every stream, resumed as the router resumes it, ends with the tokens the group
would have made, no prompt prefilled again; what is left on the node is the new engine's leases only."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.errors import RemoteError
from libs.common.events import (
    FreezeGang,
    FreezeGangReply,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    SetGpuHealth,
    SetGpuHealthReply,
)
from tests.engine.conftest import tiny_weights  # noqa: F401 - fixture
from tests.engine.test_tp import two_gpus  # noqa: F401 - fixture
from tests.engine_batched import test_failover
from tests.engine_batched.test_failover import BatchedEngine, alone, resume, streams_started
from tests.engine_batched.test_tp_gang import STREAMS
from tests.engine_batched.test_tp_kv_restore import BACKED, backed_rows


async def leases(bus: Bus, settings: CommonSettings) -> list:
    return (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases


@pytest.mark.timeout(300)
async def test_a_group_that_lost_a_gpu_is_continued_by_one_engine_from_every_ranks_backup(
        tmp_path: Path, tiny_weights: Path, two_gpus: Path, settings_env: dict[str, str],  # noqa: F811
        settings: CommonSettings, bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_failover, "MAX_TOKENS", 2 * test_failover.MAX_TOKENS)  # outlive the first rounds
    first = BatchedEngine(tmp_path, tiny_weights, "btd-a", settings_env, *BACKED)
    first.wait_ready(180)
    with ThreadPoolExecutor(STREAMS) as ex:  # deterministic mode: together as alone
        expected = dict(enumerate(ex.map(lambda i: alone(first.url, i), range(STREAMS))))
    seen, threads = streams_started(first, STREAMS)
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(backed_rows, first.url) < STREAMS:  # every stream vouched for by a round
        assert time.monotonic() < deadline and all(t.is_alive() for t in threads), "no round backed every stream"
        await asyncio.sleep(0.02)

    lost = await bus.request(settings.node, SetGpuHealth(gpu=1, healthy=False, detail="xid 79 (test)"),
                             SetGpuHealthReply)
    assert sorted(i.split("-")[0] for i in lost.lost_leases) and len(lost.lost_leases) == 2  # rank 1's weights, cache
    try:
        first.kill()  # rank 1 exits as its leases go and the group with it; the agent would kill what is left
    except ProcessLookupError:
        pass
    for t in threads:
        await asyncio.to_thread(t.join, 10)
    assert all(0 < len(s) < len(expected[i]) for i, s in seen.items()), "a stream ended before the loss"
    with pytest.raises(RemoteError) as whole:
        await bus.request(settings.node, FreezeGang(gang_id="btd-a"), FreezeGangReply)
    assert whole.value.remote_code == "partial_gang"  # no whole group can take it over any more
    frozen = await bus.request(settings.node, FreezeGang(gang_id="btd-a", degraded=True), FreezeGangReply)
    assert sorted(i.name for i in frozen.leases) == ["kv_backup.tp2-r0", "kv_backup.tp2-r1"]

    alone_engine = BatchedEngine(tmp_path, tiny_weights, "btd-b", {
        **settings_env, "HF_DEGRADE_GANG": "btd-a", "HF_TRANSFER_TOKEN": frozen.transfer_token,
        "HF_GANG_GENERATION": "1", "HF_GPU": "0"}, "--kv-backup", "--kv-backup-lag-ms", "100")
    try:
        info = alone_engine.wait_ready(180)
        rec = info["recovery"]
        assert rec["source"] == "degraded" and info["memory"]["num_blocks"] == 256  # the backups' count, not its own
        degraded = info["degraded"]
        assert degraded["restored"] == STREAMS and degraded["from_ranks"] == 2, degraded
        got = {i: await asyncio.to_thread(resume, alone_engine.url, i, list(seen[i])) for i in range(STREAMS)}
        stats = httpx.get(alone_engine.url + "/health", timeout=10).json()["engine"]
        assert got == expected  # every stream, token for token, from both ranks' backups
        assert stats["recomputed_tokens"] == 0
        floor = degraded["recomputed_tokens"] + stats["claim_extra_tokens"]  # past the durable point only
        assert floor <= stats["prefill_tokens"] <= floor + STREAMS, (stats["prefill_tokens"], floor)
        left = await leases(bus, settings)
        assert {i.owner for i in left} == {"btd-b"} and {i.state for i in left} == {LeaseState.ACTIVE}
        assert {i.gpu for i in left} == {0} and "kv_backup" in {i.name for i in left}  # a backup of its own
    finally:
        alone_engine.child.stop()
