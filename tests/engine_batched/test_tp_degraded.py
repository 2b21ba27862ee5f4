"""Degraded tensor parallelism (issue 22 part 6; engines/batched/degrade.py): a batched group of N ranks with
`--kv-backup` on N simulated GPUs (real gpu_manager, real processes) serves 4 greedy streams, each vouched for by a
backup round; GPU 1 is marked failed (that rank's weights and cache lost: the gang broken) and the group dies.
No N GPUs are left for a whole successor group, so a group of N-1 ranks on the GPUs left (0 and 2 for TP=3: named
rank by rank, `HF_ENGINE_RANK_GPUS`) takes the gang's N
backups over (the rest of the gang reclaimed in the same commit), loads its shards cold and restores every
sequence's KV from all N backups, each kv head into its new rank's cache: TP=2 -> one engine (tiny), and TP=3 ->
TP=2 (tiny3: 3 kv heads, 1/1/1 -> 2/1, rank 0 sending rank 1 its heads). Every stream, resumed as the router
resumes it, ends with the tokens the group would have made, no prompt prefilled again; what is left on the node is
the new engine's leases only."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from engines.reference.config import get_config
from engines.reference.weights import make_weights
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
from tests.engine.conftest import end_processes_of, start_gpu_manager
from tests.engine_batched import test_failover
from tests.engine_batched.test_failover import BatchedEngine, resume
from tests.engine_batched.test_tp_gang import STREAMS
from tests.engine_batched.test_tp_kv_restore import streams_backed_up

BACKUP = ("--kv-backup", "--kv-backup-lag-ms", "100")


async def leases(bus: Bus, settings: CommonSettings) -> list:
    return (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("size", "ranks"), [("tiny", 2), ("tiny3", 3)], ids=["tp2-to-1", "tp3-to-2"])
async def test_a_group_that_lost_a_gpu_is_continued_by_fewer_ranks_from_every_ranks_backup(
        tmp_path: Path, settings_env: dict[str, str], settings: CommonSettings, bus: Bus,
        monkeypatch: pytest.MonkeyPatch, size: str, ranks: int) -> None:
    monkeypatch.setattr(test_failover, "MAX_TOKENS", 2 * test_failover.MAX_TOKENS)  # outlive the first rounds
    weights = make_weights(get_config(size), tmp_path / f"{size}.safetensors", seed=7)
    manager = start_gpu_manager(settings, {**settings_env, "HF_GPUS": json.dumps([str(g) for g in range(ranks)])},
                                tmp_path)
    try:
        await degraded_by_one_gpu(tmp_path, weights, size, ranks, settings_env, settings, bus)
    finally:
        manager.stop()
        end_processes_of(settings.state_dir)


async def lose_gpu(bus: Bus, settings: CommonSettings, gpu: int) -> None:
    """GPU `gpu` marked failed: the rank there loses its weights and cache (and exits as they go)."""
    lost = await bus.request(settings.node, SetGpuHealth(gpu=gpu, healthy=False, detail="xid 79 (test)"),
                             SetGpuHealthReply)
    assert len(lost.lost_leases) == 2  # that rank's weights and cache


async def degraded_by_one_gpu(tmp_path: Path, weights: Path, size: str, ranks: int, settings_env: dict[str, str],
                              settings: CommonSettings, bus: Bus, *, device: tuple[str, ...] = (),
                              lose: Callable[[int], Awaitable[None]] | None = None) -> None:
    """`device`: more flags of both groups (`--tp-one-gpu --device cuda`: every rank on the one GPU); `lose(rank)`:
    how rank `rank`'s GPU memory is lost (default: its GPU marked failed)."""
    lost_gpu, left = 1, ranks - 1  # TP=3: the middle GPU, so the group of 2 runs on GPUs 0 and 2 (rank_gpus)
    gpus_left = [0] * left if device else [g for g in range(ranks) if g != lost_gpu]
    first = BatchedEngine(tmp_path, weights, "btd-a", settings_env, "--size", size, "--tp", str(ranks),
                          "--num-blocks", "256", *BACKUP, *device)
    expected, seen, threads = await streams_backed_up(first)

    await (lose(lost_gpu) if lose is not None else lose_gpu(bus, settings, lost_gpu))
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
    assert sorted(i.name for i in frozen.leases) == [f"kv_backup.tp{ranks}-r{r}" for r in range(ranks)]

    successor = BatchedEngine(tmp_path, weights, "btd-b", {
        **settings_env, "HF_DEGRADE_GANG": "btd-a", "HF_TRANSFER_TOKEN": frozen.transfer_token,
        "HF_GANG_GENERATION": "1", "HF_GPU": "0",
        **({"HF_ENGINE_RANK_GPUS": json.dumps(gpus_left)} if left > 1 and not device else {})},
        "--size", size, *(["--tp", str(left)] if left > 1 else []), *BACKUP,
        *(d for d in device if left > 1 or d != "--tp-one-gpu"))
    try:
        owners = ["btd-b", *(f"btd-b-r{r}" for r in range(1, left))]
        await continued_from_backups(successor, expected, seen, ranks, owners, gpus_left, bus, settings)
        assert {i.owner for i in await leases(bus, settings)} == set(owners)  # nothing of the broken gang left
    finally:
        successor.child.stop()


async def continued_from_backups(successor: BatchedEngine, expected: dict[int, list[int]], seen: dict[int, list[int]],
                                 from_ranks: int, owners: list[str], gpus: list[int], bus: Bus,
                                 settings: CommonSettings) -> dict:
    """`successor` (ranks `owners`, on `gpus`) ready from `from_ranks` ranks' KV backups: its caches of the backups'
    block count (256), every stream restored; each stream, resumed as the router resumes it, ends with the tokens of
    an uninterrupted run, none recomputed, no prompt prefilled again (only the positions past the backups' durable
    point); every rank holds its own weights, cache and backup, live, a group's registered as its gang. Its ready
    info."""
    info = successor.wait_ready(180)
    to_ranks = len(owners)
    assert info["recovery"]["source"] == "degraded" and info["memory"]["num_blocks"] == 256  # the backups' count
    degraded = info["degraded"]
    assert degraded["restored"] == STREAMS and (degraded["from_ranks"], degraded["to_ranks"]) == (from_ranks, to_ranks)
    got = {i: await asyncio.to_thread(resume, successor.url, i, list(seen[i])) for i in range(STREAMS)}
    stats = httpx.get(successor.url + "/health", timeout=10).json()["engine"]
    assert got == expected  # every stream, token for token, from the backups
    assert stats["recomputed_tokens"] == 0
    floor = degraded["recomputed_tokens"] + stats["claim_extra_tokens"]  # past the durable point only
    assert floor <= stats["prefill_tokens"] <= floor + STREAMS, (stats["prefill_tokens"], floor)
    mine = [i for i in await leases(bus, settings) if i.owner in owners]
    assert {i.state for i in mine} == {LeaseState.ACTIVE}
    assert sorted((i.owner, i.tag.value) for i in mine) == sorted(
        (o, tag) for o in owners for tag in ("kv_cache", "other", "weights"))  # the backup: a host lease (`other`)
    assert {(i.owner, i.gpu) for i in mine if i.tag.value == "weights"} == set(zip(owners, gpus, strict=True))
    backups = sorted(i.name for i in mine if i.name.startswith("kv_backup"))
    assert backups == (["kv_backup"] if to_ranks == 1 else [f"kv_backup.tp{to_ranks}-r{r}" for r in range(to_ranks)])
    if to_ranks > 1:  # the group's own leases registered as its gang
        assert info["tp"]["gang"]["owners"] == owners and len(info["tp"]["gang"]["epochs"]) == 3 * to_ranks
    return info
