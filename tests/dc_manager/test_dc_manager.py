"""The dc_manager process: killed in the middle of a takeover, its intent is redelivered and finished."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from bench.controlplane import SimulatedCluster
from libs.common.bus import Bus
from libs.common.events import IntentResult, RecoverIntent
from libs.common.store import Store
from tests.controller.helpers import healthy, service_env, start, wait_for


async def test_a_dc_manager_killed_mid_takeover_is_redelivered_the_intent_and_does_not_freeze_twice(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=1, emit_events=False)
    sim.takeover_gate = asyncio.Event()
    await sim.populate()
    await sim.serve()
    env = service_env(settings_env, HF_ACK_WAIT_S="1", HF_TAKEOVER_TIMEOUT_S="30")
    victim = sim.engine_id("n0000", 0)
    first = start("services.dc_manager", env, tmp_path / "dcm1.log")
    second = None
    try:
        await healthy(bus, "dc_manager", "dc-1")
        await bus.emit(RecoverIntent(incident_id="inc-x", engine_id=victim, model="m", node="n0000", gpu=0))
        await asyncio.wait_for(sim.takeover_started.wait(), 15)
        assert sim.freeze_calls == 1
        first.kill(signal.SIGKILL)
        first.proc.wait(5)  # type: ignore[union-attr]
        second = start("services.dc_manager", env, tmp_path / "dcm2.log")
        await healthy(bus, "dc_manager", "dc-1")
        await wait_for(lambda: _takeover_calls(sim, 2), what="the takeover sent again")
        sim.takeover_gate.set()

        async def reattached() -> list[IntentResult] | None:
            got = [e.data for e in await bus.replay("intent.result") if isinstance(e.data, IntentResult)]
            return got if any(r.step == "reattach" for r in got) else None

        results = await wait_for(reattached, what="the reattach result")
        assert [(r.step, r.ok) for r in results] == [("freeze", True), ("reattach", True)]  # each once
        assert results[1].successor_id == f"{victim}-s1"
        assert sim.freeze_calls == 1  # the recorded transfer token was reused, not a second freeze
        assert len(sim.takeovers) == 1
    finally:
        first.stop()
        if second is not None:
            second.stop()


async def _takeover_calls(sim: SimulatedCluster, n: int) -> bool:
    return sim.takeover_calls >= n
