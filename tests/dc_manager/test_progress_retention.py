"""A finished intent's progress record (`dcm/intents/<key>`) leaves etcd after its retention; a running intent's
stays however long it runs; records an earlier manager left go too (libs/common/retention.py; a real dc_manager
process, simulated nodes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from devstack.simcluster import SimulatedCluster
from libs.common.bus import Bus
from libs.common.events import IntentResult, RecoverIntent, Step
from libs.common.store import Store
from services.dc_manager.executor import IntentExecutor, IntentProgress, progress_key
from tests.controller.helpers import healthy, service_env, start, wait_for


async def test_a_finished_intents_progress_record_is_deleted_a_running_ones_is_kept(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=1, emit_events=False)
    sim.takeover_gate = asyncio.Event()
    await sim.populate()
    await sim.serve()
    results: asyncio.Queue[IntentResult] = asyncio.Queue()

    async def on_result(env: object) -> None:
        data = getattr(env, "data", None)
        if isinstance(data, IntentResult) and data.step is Step.REATTACH:
            await results.put(data)

    await bus.subscribe("intent.result", on_result)
    env = service_env(settings_env, HF_PROGRESS_RETENTION_S="0.3", HF_PROGRESS_RETENTION_MIN_S="0",
                      HF_PROGRESS_RETENTION_CHECK_S="0.1")
    # Left by a manager that died: one readable record, one not.
    await store.put(progress_key("inc-left-recover"), IntentProgress(key="inc-left-recover", incident_id="inc-left"))
    await store.put(progress_key("inc-bad-recover"), "not a progress record")
    child = start("services.dc_manager", env, tmp_path / "dcm.log")
    try:
        await healthy(bus, "dc_manager", "dc-1")
        intent = RecoverIntent(incident_id="inc-r", engine_id=sim.engine_id("n0000", 0), model="m", node="n0000", gpu=0)
        key = progress_key(IntentExecutor.key_of(intent))
        await bus.emit(intent)
        await asyncio.wait_for(sim.takeover_started.wait(), 15)
        await wait_for(lambda: store.get(key), what="the freeze's progress recorded")
        await asyncio.sleep(1.0)  # over three retentions while the takeover is held: a running intent's record stays
        assert await store.get(key) is not None
        sim.takeover_gate.set()
        got = await asyncio.wait_for(results.get(), 15)
        assert got.ok and got.incident_id == "inc-r"
        await wait_for(lambda: _gone(store, key), what="the finished intent's record deleted")
        for left in ("inc-left-recover", "inc-bad-recover"):
            await wait_for(lambda left=left: _gone(store, progress_key(left)), what=f"the leftover {left} deleted")
    finally:
        child.stop()


async def _gone(store: Store, key: str) -> bool:
    return await store.get(key) is None
