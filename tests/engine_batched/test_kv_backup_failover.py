"""The batched engine's KV backup to host through the loss of its KV memory (real gpu_manager on the host backend,
real processes, real signals): 16 greedy streams in flight with `--kv-backup`; the engine's KV lease is reclaimed
by force (the gpu_manager's "this memory is gone") and the engine SIGKILLed (a lost GPU takes its process with it);
the freeze hands on what is left (weights and the backup lease); a successor takes them over, leases a new cache,
restores every vouched-for block from the backup, and each stream, resumed the way the router resumes it, ends
with exactly the tokens of an uninterrupted run. Prefill is not recomputed: only the positions past the backup's
durable point (a lag's worth of decode at most) are, and they are counted.

The lease is reclaimed, not the keeper and manager killed: those hold the backup lease too (a memfd lives while
one of the keeper, the manager or a mapping engine holds it), so killing all three would lose the backup with the
cache; reclaiming the cache's lease alone is the loss this path is for."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import Freeze, FreezeReply, ListLeases, ListLeasesReply, Reclaim, ReclaimReply, Tag
from tests.engine.conftest import gpu_manager, tiny_weights  # noqa: F401 - fixtures
from tests.engine_batched import test_failover
from tests.engine_batched.test_failover import (
    STREAMS,
    BatchedEngine,
    resume,
    streams_started,
    uninterrupted,
)


def backup_stats(url: str) -> dict:
    return dict(httpx.get(url + "/health", timeout=10).json()["kv_backup"])


async def just_past_a_round(url: str, seen: dict[int, list[int]]) -> None:
    """Until the clients have seen more tokens than the backup vouches for, every stream still backed up and no round
    running: some client saw tokens past the backup's durable point."""
    while True:
        st = await asyncio.to_thread(backup_stats, url)
        if st["rows"] == STREAMS and st["in_round_since"] is None and sum(map(len, seen.values())) > st["durable_tokens"]:
            return
        assert sum(map(len, seen.values())) < STREAMS * test_failover.MAX_TOKENS, "the streams ended first"
        await asyncio.sleep(0.01)


async def lose_kv_and_take_over(first: BatchedEngine, tmp_path: Path, tiny_weights: Path,  # noqa: F811
                                settings_env: dict[str, str], settings: CommonSettings, bus: Bus,
                                between_rounds: bool) -> tuple[dict, dict, dict[int, list[int]], dict[int, list[int]], list]:
    expected = await asyncio.to_thread(uninterrupted, first.url)
    seen, threads = await asyncio.to_thread(streams_started, first, STREAMS)
    if between_rounds:
        await just_past_a_round(first.url, seen)
    else:
        await asyncio.sleep(0.3)  # decode under way, the backup rounds behind it
    leases = (await bus.request(settings.node, ListLeases(owner="bat-a"), ListLeasesReply)).leases
    (kv,) = [lease for lease in leases if lease.tag is Tag.KV_CACHE]
    await bus.request(settings.node, Reclaim(lease_id=kv.id, force=True), ReclaimReply)
    first.kill()  # the GPU's memory went, and the engine with it
    for t in threads:
        await asyncio.to_thread(t.join, 10)
    frozen = await bus.request(settings.node, Freeze(owner="bat-a"), FreezeReply)
    successor = BatchedEngine(tmp_path, tiny_weights, "bat-b", {**settings_env, "HF_TAKEOVER_FROM": "bat-a",
                                                                "HF_TRANSFER_TOKEN": frozen.transfer_token},
                              "--kv-backup")
    info = await asyncio.to_thread(successor.wait_ready)
    try:
        got = {i: await asyncio.to_thread(resume, successor.url, i, list(seen[i])) for i in range(STREAMS)}
        health = httpx.get(successor.url + "/health", timeout=10).json()
    finally:
        successor.child.stop()
    return info, health, expected, got, frozen.leases


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lag_ms", [100, 1000], ids=["lag-100ms", "lag-1s"])
async def test_sixteen_streams_continue_exactly_from_the_host_backup_after_the_kv_lease_is_lost(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],  # noqa: F811
        settings: CommonSettings, bus: Bus, lag_ms: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a 1 s lag (a round every 0.5 s) the loss lands two steps after a round: the decode since then is past the
    durable point, made again from the backed tokens and the tokens the clients saw (and still exact). (A 3 s lag
    let a quiet machine finish every stream before the first round, 1.5 s in.) The 1 s lag's streams are twice as
    long: on a loaded machine 160 tokens could all be made before a round between steps was seen."""
    if lag_ms >= 1000:
        monkeypatch.setattr(test_failover, "MAX_TOKENS", 2 * test_failover.MAX_TOKENS)
    first = BatchedEngine(tmp_path, tiny_weights, "bat-a", settings_env, "--kv-backup", "--kv-backup-lag-ms",
                          str(lag_ms))
    before = first.wait_ready()
    assert before["kv_backup"]["rounds"] == 0
    t0 = time.monotonic()
    info, health, expected, got, handed = await lose_kv_and_take_over(first, tmp_path, tiny_weights, settings_env,
                                                                       settings, bus, lag_ms >= 1000)
    assert {lease.name for lease in handed} == {"weights", "kv_backup"}  # the cache's lease is gone
    rec, stats, restore = info["recovery"], health["engine"], info["recovery"]["kv_backup"]
    assert rec["source"] == "takeover" and rec["journal"] == "adopted"
    # every stream still running when the cache was lost (a 3 s lag's wait may see some end first) is restored
    assert restore["source"] == "restored" and restore["restored"] >= STREAMS // 2 and restore["dropped"] == 0
    assert rec["adopted"] == restore["restored"]
    assert got == expected  # every stream, token for token: none lost, none twice
    # nothing of any prompt prefilled again: the successor computed only positions past the durable point (the lag's
    # decode, fed one a step in deterministic mode) and the tokens its clients saw past the backup
    assert stats["recomputed_tokens"] == 0
    # Beyond those, at most a token a stream: once, on a loaded 2-core CI run (2026-12-02), 4 tokens more than the
    # two counts were computed in multi-token steps (295 = 289 + 2 + 4), the streams exact all the same; which
    # tokens they were is not established (a stream's pending token fed beside a claim's is the suspect).
    floor = restore["recomputed_tokens"] + stats["claim_extra_tokens"]
    assert floor <= stats["prefill_tokens"] <= floor + STREAMS, (stats["prefill_tokens"], floor)
    # past the durable point: positions recomputed inside a backed row, and the tokens the clients had seen past the
    # backup (made again: decoded ahead before the claims came, or fed as the clients saw them)
    past = restore["recomputed_tokens"] + stats["claim_past_adopted_tokens"]
    if lag_ms >= 1000:
        assert past > 0  # the loss came two steps after a round: the tokens since it were made again
    print(f"restored {restore['restored']} sequences, {restore['blocks']} blocks in {restore['ms']} ms; past the "
          f"durable point {past} tokens ({restore['recomputed_tokens']} in rows, {stats['claim_past_adopted_tokens']} "
          f"seen by clients, {stats['claim_extra_tokens']} of them fed); {time.monotonic() - t0:.1f} s")
