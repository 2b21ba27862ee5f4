"""A tensor-parallel batched engine's leases as one gang (real gpu_manager, host backend, two simulated GPUs): each
rank's shard and KV cache in leases of its own on its own GPU; the group SIGKILLed with streams in flight, its gang
frozen and taken over by a new group (no weights file), which adopts rank 0's journal and continues every sequence
on every rank's KV: each stream, resumed as the router resumes it, ends with the tokens of an uninterrupted run,
with no prefill recomputed (deterministic mode)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import FreezeGang, FreezeGangReply, LeaseState, ListLeases, ListLeasesReply
from tests.engine.conftest import tiny_weights  # noqa: F401 - fixture
from tests.engine.test_tp import two_gpus  # noqa: F401 - fixture
from tests.engine_batched.test_failover import BatchedEngine, alone, resume, streams_started
from tests.engine_batched.test_tp import follower_pids

STREAMS = 4
GROUP = ("--tp", "2", "--num-blocks", "256")


def kill_mid_generation(first: BatchedEngine) -> dict[int, list[int]]:
    """Every stream started, then rank 0 SIGKILLed (rank 1 and its HTTP front die with it); the tokens each client
    saw."""
    seen, threads = streams_started(first, STREAMS)
    followers = follower_pids(first.child.pid, front=0)  # every child
    first.kill()
    for t in threads:
        t.join(10)
    deadline = time.monotonic() + 10
    while any(procs.pid_alive(p) for p in followers):
        assert time.monotonic() < deadline, "rank 1 or the front outlived rank 0"
        time.sleep(0.05)
    return seen


async def test_a_frozen_gang_is_taken_over_by_a_new_group_that_continues_every_sequence(
        tmp_path: Path, tiny_weights: Path, two_gpus: Path, settings_env: dict[str, str],  # noqa: F811
        settings: CommonSettings, bus: Bus) -> None:
    await gang_taken_over(tmp_path, tiny_weights, settings_env, settings, bus, GROUP, gpus=(0, 1))


def successor_group(tmp_path: Path, tiny_weights: Path, engine_id: str, env: dict[str, str],  # noqa: F811
                    gang: str, frozen: FreezeGangReply, group: tuple[str, ...]) -> BatchedEngine:
    """A new group taking the frozen `gang` over (generation 1), the weights file renamed away first: it has the
    leases only."""
    tiny_weights.rename(tiny_weights.with_suffix(".gone"))
    return BatchedEngine(tmp_path, tiny_weights, engine_id, {
        **env, "HF_TAKEOVER_GANG": gang, "HF_TRANSFER_TOKEN": frozen.transfer_token, "HF_GANG_GENERATION": "1"},
        *group)


async def gang_taken_over(tmp_path: Path, tiny_weights: Path, env: dict[str, str],  # noqa: F811
                          settings: CommonSettings, bus: Bus, group: tuple[str, ...], gpus: tuple[int, int]) -> None:
    """A group of `group` serving 4 streams is SIGKILLed, its gang frozen and taken over by a new group without the
    weights file; every stream ends with its uninterrupted tokens. Rank r's leases are on GPU `gpus[r]`."""
    first = BatchedEngine(tmp_path, tiny_weights, "btg-a", env, *group)
    info = first.wait_ready(180)
    gang = info["tp"]["gang"]
    assert gang["owners"] == ["btg-a", "btg-a-r1"] and gang["generation"] == 1 and len(gang["epochs"]) == 4
    leases = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
    assert {(i.owner, i.gpu, i.tag.value) for i in leases} == {
        ("btg-a", gpus[0], "weights"), ("btg-a", gpus[0], "kv_cache"), ("btg-a-r1", gpus[1], "weights"),
        ("btg-a-r1", gpus[1], "kv_cache")}
    with ThreadPoolExecutor(STREAMS) as ex:  # deterministic mode: together as alone
        expected = dict(enumerate(ex.map(lambda i: alone(first.url, i), range(STREAMS))))
    seen = kill_mid_generation(first)
    assert all(0 < len(s) < len(expected[i]) for i, s in seen.items())  # every stream was cut mid-generation
    frozen = await bus.request(settings.node, FreezeGang(gang_id="btg-a"), FreezeGangReply)
    assert frozen.generation == 1 and {i.state for i in frozen.leases} == {LeaseState.FROZEN}
    second = successor_group(tmp_path, tiny_weights, "btg-b", env, "btg-a", frozen, group)
    try:
        info = second.wait_ready(180)
        rec = info["recovery"]
        assert info["memory"]["source"] == "takeover" and rec["journal"] == "adopted"
        assert rec["adopted"] == STREAMS and rec["dropped"] == 0
        assert info["tp"]["gang"]["owners"] == ["btg-b", "btg-b-r1"] and info["tp"]["gang"]["generation"] == 2
        got = {i: resume(second.url, i, list(seen[i])) for i in range(STREAMS)}
        stats = httpx.get(second.url + "/health", timeout=10).json()["engine"]
        assert got == expected  # every stream, token for token, from every rank's handed-on KV
        assert stats["claimed"] == STREAMS and stats["prefill_tokens"] == 0 and stats["recomputed_tokens"] == 0
        after = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
        assert sorted((i.id, i.owner, i.epoch) for i in after) == sorted(
            (i.id, i.owner.replace("btg-a", "btg-b"), i.epoch + 1) for i in frozen.leases)  # the same four, moved
    finally:
        second.child.stop()
