"""The dc_manager process: killed in the middle of a takeover, its intent is redelivered and finished."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

from devstack.simcluster import SimulatedCluster
from libs.common import procs
from libs.common.bus import Bus
from libs.common.events import IntentResult, RecoverIntent
from libs.common.store import Store
from tests.controller.helpers import healthy, service_env, start, wait_for


class _Crash:
    """One simulated engine whose intent a dc_manager process handles; `replace` kills that process (SIGKILL) and
    starts another, which JetStream redelivers the unacked intent to."""

    def __init__(self, bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
        self.bus, self.tmp_path = bus, tmp_path
        self.sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=1, emit_events=False)
        self.env = service_env(settings_env, HF_ACK_WAIT_S="1", HF_TAKEOVER_TIMEOUT_S="30")
        self.victim = self.sim.engine_id("n0000", 0)
        self.procs: list[procs.Child] = []

    async def begin(self, incident_id: str) -> None:
        await self.sim.populate()
        await self.sim.serve()
        await self._start()
        await self.bus.emit(RecoverIntent(incident_id=incident_id, engine_id=self.victim, model="m", node="n0000", gpu=0))

    async def replace(self) -> None:
        self.procs[-1].kill(signal.SIGKILL)
        self.procs[-1].proc.wait(5)  # type: ignore[union-attr]
        await self._start()

    async def _start(self) -> None:
        self.procs.append(start("services.dc_manager", self.env, self.tmp_path / f"dcm{len(self.procs) + 1}.log"))
        await healthy(self.bus, "dc_manager", "dc-1")

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


async def test_a_dc_manager_killed_mid_takeover_is_redelivered_the_intent_and_does_not_freeze_twice(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    crash = _Crash(bus, store, settings_env, tmp_path)
    sim, victim = crash.sim, crash.victim
    sim.takeover_gate = asyncio.Event()
    try:
        await crash.begin("inc-x")
        await asyncio.wait_for(sim.takeover_started.wait(), 15)
        assert sim.freeze_calls == 1
        await crash.replace()
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
        crash.stop()


async def test_a_dc_manager_killed_after_the_node_took_over_gets_the_same_successor_on_redelivery(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    """The takeover's reply is not recorded: a manager that dies once the node has taken over (reply not yet
    seen, result not published) leaves only the freeze's record; its successor process re-sends the takeover
    with the recorded token and the node, idempotent by incident, answers with the first takeover's successor."""
    crash = _Crash(bus, store, settings_env, tmp_path)
    sim, victim = crash.sim, crash.victim
    sim.reply_gate = asyncio.Event()
    try:
        await crash.begin("inc-y")
        await wait_for(lambda: _taken_over(sim, "inc-y"), what="the node's takeover done")
        progress = json.loads(await store.get("dcm/intents/inc-y-recover") or b"{}")
        assert progress.get("freeze") is not None and progress.get("takeover") is None  # what a redelivery finds
        await crash.replace()
        await wait_for(lambda: _takeover_calls(sim, 2), what="the takeover sent again")
        sim.reply_gate.set()
        await wait_for(lambda: _results(bus, "inc-y", "reattach"), what="the reattach result")
        await asyncio.sleep(0.7)  # room for a duplicate result to show up
        got = await _results(bus, "inc-y", "reattach") or []
        assert [(r.step, r.ok, r.successor_id) for r in got if r.step == "reattach"] == [("reattach", True, f"{victim}-s1")]
        assert sim.freeze_calls == 1  # the recorded token was reused: no second freeze
        assert len(sim.takeovers) == 1 and [e for e in sim.engines if e.startswith(f"{victim}-s")] == [f"{victim}-s1"]
    finally:
        crash.stop()


async def _taken_over(sim: SimulatedCluster, incident_id: str) -> bool:
    fut = sim.takeovers.get(incident_id)
    return fut is not None and fut.done()


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
