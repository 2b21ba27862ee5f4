"""The batched engine sleeps and wakes on the control plane's ask (issue 21): a real gpu_manager (host backend), the
engine a real process on the tiny model (CPU), the ask sent as the node command the controller sends. While
asleep the KV lease is SLEEPING and its memory is mapped by nobody (level 2: the weights' too), /generate answers
503; after the wake every output equals the one before the sleep."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from libs.common.events import LeaseState, ListLeases, ListLeasesReply, SleepEngine, SleepEngineReply
from tests.engine.conftest import gpu_manager, tiny_weights  # noqa: F401 - fixtures
from tests.engine_batched.test_failover import BatchedEngine, alone
from tests.gpu_manager.harness import holds_lease_memory

NODE = "node-1"


def mapped_leases(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("level", [1, 2])
async def test_outputs_after_a_wake_equal_those_before_the_sleep(level: int, tmp_path: Path, tiny_weights: Path,  # noqa: F811
                                                                gpu_manager: Path, settings_env: dict[str, str],  # noqa: F811
                                                                bus) -> None:  # noqa: ANN001
    eng = BatchedEngine(tmp_path, tiny_weights, f"bat-sleep-{level}", settings_env, "--num-blocks", "128")
    try:
        await asyncio.to_thread(eng.wait_ready)
        engine_id, pid = f"bat-sleep-{level}", eng.child.proc.pid  # type: ignore[union-attr]
        before = [await asyncio.to_thread(alone, eng.url, i) for i in range(3)]
        leases = (await bus.request(NODE, ListLeases(owner=engine_id), ListLeasesReply)).leases
        kv = next(lease for lease in leases if lease.tag == "kv_cache")
        asleep = {kv.id} | ({lease.id for lease in leases} if level == 2 else set())

        slept = await bus.request(NODE, SleepEngine(engine_id=engine_id, level=level, timeout_s=60), SleepEngineReply,
                                  timeout=90)
        assert slept.state == "sleeping" and set(slept.lease_ids) == asleep
        assert slept.bytes == sum(lease.size for lease in leases if lease.id in asleep)
        now = {lease.id: lease.state for lease in
               (await bus.request(NODE, ListLeases(owner=engine_id), ListLeasesReply)).leases}
        assert all(now[i] == LeaseState.SLEEPING for i in asleep)
        maps = mapped_leases(pid)
        assert not any(f"hf-{i}-" in maps for i in asleep)  # the engine maps none of their memory
        assert not any(holds_lease_memory(pid, i) for i in asleep)
        r = await asyncio.to_thread(httpx.post, eng.url + "/generate", json={"prompt": "x", "max_tokens": 2},
                                    timeout=10)
        assert r.status_code == 503
        health = (await asyncio.to_thread(httpx.get, eng.url + "/health", timeout=10)).json()
        assert health["state"] == "sleeping" and health["sleep"]["bytes"] == slept.bytes

        woke = await bus.request(NODE, SleepEngine(engine_id=engine_id, wake=True, timeout_s=60), SleepEngineReply,
                                 timeout=90)
        assert woke.state == "awake" and set(woke.lease_ids) == asleep
        assert (woke.weights_source is not None) == (level == 2)
        after = [await asyncio.to_thread(alone, eng.url, i) for i in range(3)]
        assert after == before
    finally:
        eng.child.stop()
