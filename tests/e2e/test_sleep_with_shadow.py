"""A sleeping batched engine's memory is really given back although a warm standby shadowed it: the engine tells its
agent it sleeps, the agent drops the standby's shadow (a mapping of the engine's leases would keep their memory
alive: docs/restore.md), and offers it again once the engine is awake (the whole stack: nats, etcd, gpu_manager,
agent, controller, dc_manager, router; host backend, the tiny model, real processes)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from bench.load_recovery import LoadScenario
from libs.common import procs
from libs.common.events import ListLeases, ListLeasesReply, SleepEngine, SleepEngineReply, Tag


def _mapped_by(pids: list[int], lease_id: str) -> list[int]:
    """The processes that map or hold open a memfd of the lease (`hf-<lease>-<i>`)."""
    name = f"hf-{lease_id}-"
    out = []
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = [os.readlink(e) for e in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        if name in maps or any(name in f for f in fds):
            out.append(pid)
    return out


async def _until(check, timeout: float = 30.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.1)


@pytest.mark.timeout(300)
async def test_a_sleeping_engines_shadow_is_dropped_so_its_memory_goes_and_offered_again_on_wake(tmp_path: Path) -> None:
    sc = LoadScenario(size="tiny", backend="host", standbys=1, max_num_seqs=16, kv_cache_gib=None, work_dir=tmp_path)
    await asyncio.to_thread(sc.start)
    try:
        await sc.connect()
        assert sc.bus is not None and sc.stack is not None
        active = await sc.wait_serving()  # the standby shadows it already (LoadScenario waits for that on the CPU)
        node = sc.stack.config.node
        leases = await sc.bus.request(node, ListLeases(owner=active.engine_id), ListLeasesReply, timeout=5)
        kv = next(info.id for info in leases.leases if info.tag == Tag.KV_CACHE)
        pids = procs.pids_with_env("HF_STATE_DIR", str(sc.stack.base_dir / "state"))
        assert len(_mapped_by(pids, kv)) >= 3  # the engine, its shadow, the manager and its keeper

        slept = await sc.bus.request(node, SleepEngine(engine_id=active.engine_id, level=1, timeout_s=30),
                                     SleepEngineReply, timeout=40)
        assert slept.bytes > 0

        async def dropped() -> bool:
            standbys = [e for e in await sc.engines() if e.role == "standby"]
            return bool(standbys) and all(e.shadows is None for e in standbys) and not _mapped_by(pids, kv)

        await _until(dropped)  # no process holds the sleeping cache's memory: it is gone

        await sc.bus.request(node, SleepEngine(engine_id=active.engine_id, wake=True, timeout_s=30),
                             SleepEngineReply, timeout=40)

        async def shadowed_again() -> bool:
            return any(e.role == "standby" and e.shadows == active.engine_id for e in await sc.engines())

        await _until(shadowed_again)
    finally:
        await sc.close()
        sc.stop()
