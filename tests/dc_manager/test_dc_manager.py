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
        await asyncio.sleep(0.7)  # room for a duplicate result to show up
        results = [e.data for e in await bus.replay("intent.result") if isinstance(e.data, IntentResult)]
        final = [r for r in results if r.step == "reattach"]
        assert len(final) == 1 and final[0].ok and final[0].successor_id == f"{victim}-s1"
        # A freeze result only when a takeover ran long after its freeze (here: gated), and never twice.
        assert [(r.step, r.ok) for r in results if r.step != "reattach"] in ([], [("freeze", True)])
        frozen_at = {r.frozen_at for r in results}
        assert len(frozen_at) == 1 and None not in frozen_at  # the recorded freeze's time, not a new one
        assert sim.freeze_calls == 1  # the recorded transfer token was reused, not a second freeze
        assert len(sim.takeovers) == 1
    finally:
        first.stop()
        if second is not None:
            second.stop()


async def _takeover_calls(sim: SimulatedCluster, n: int) -> bool:
    return sim.takeover_calls >= n


async def test_a_prompt_takeover_gets_one_result_and_a_slow_one_gets_the_freeze_result_first(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=2, emit_events=False)
    await sim.populate()
    await sim.serve()
    env = service_env(settings_env, HF_FREEZE_RESULT_AFTER_S="0.3")
    dcm = start("services.dc_manager", env, tmp_path / "dcm.log")
    try:
        await healthy(bus, "dc_manager", "dc-1")
        prompt, slow = sim.engine_id("n0000", 0), sim.engine_id("n0000", 1)
        await bus.emit(RecoverIntent(incident_id="inc-prompt", engine_id=prompt, model="m", node="n0000", gpu=0))
        got = await wait_for(lambda: _results(bus, "inc-prompt", "reattach"), what="the prompt intent's result")
        assert [(r.step, r.ok) for r in got] == [("reattach", True)]
        assert got[0].frozen_at is not None and got[0].timings_ms.keys() >= {"freeze", "reattach"}

        sim.takeover_gate = asyncio.Event()
        await bus.emit(RecoverIntent(incident_id="inc-slow", engine_id=slow, model="m", node="n0000", gpu=1))
        first = await wait_for(lambda: _results(bus, "inc-slow", "freeze"), what="the slow takeover's freeze result")
        assert [(r.step, r.ok) for r in first] == [("freeze", True)] and first[0].frozen_at is not None
        sim.takeover_gate.set()
        both = await wait_for(lambda: _results(bus, "inc-slow", "reattach"), what="the slow intent's result")
        assert [(r.step, r.ok) for r in both] == [("freeze", True), ("reattach", True)]
        assert both[1].frozen_at == first[0].frozen_at
    finally:
        dcm.stop()


async def _results(bus: Bus, incident_id: str, until: str) -> list[IntentResult] | None:
    got = [e.data for e in await bus.replay("intent.result")
           if isinstance(e.data, IntentResult) and e.data.incident_id == incident_id]
    return got if any(r.step == until for r in got) else None
