"""A recover intent redelivered after its incident ended (resolved another way, or failed: its record says so in
etcd, written before the end is announced) is abandoned: no node command, no result (issue 18: a late result
of a redelivered intent was applied to an incident already ended)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from libs.common.bus import Bus
from libs.common.events import IntentResult
from libs.common.store import Store
from tests.dc_manager.test_dc_manager import _Crash, _takeover_calls


async def test_an_intent_redelivered_after_its_incident_ended_sends_nothing_more(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    crash = _Crash(bus, store, settings_env, tmp_path)
    sim = crash.sim
    sim.takeover_gate = asyncio.Event()  # the first manager's takeover never answers
    try:
        await crash.begin("inc-ended")
        await asyncio.wait_for(sim.takeover_started.wait(), 15)
        # The incident ends meanwhile (here: its record says resolved, as the controller writes it before the end).
        await store.put("incidents/inc-ended", {"id": "inc-ended", "engine_id": crash.victim, "state": "resolved"})
        await crash.replace()  # killed: JetStream redelivers the unacked intent to the next manager
        await asyncio.sleep(4.0)  # ack wait (1 s) and room for a takeover or a result to show up
        assert sim.takeover_calls == 1 and not await _takeover_calls(sim, 2)
        results = [e.data for e in await bus.replay("intent.result") if isinstance(e.data, IntentResult)]
        assert [r for r in results if r.incident_id == "inc-ended"] == []
        log = (tmp_path / "dcm2.log").read_text()
        assert "inc-ended-recover abandoned: its incident is resolved already" in log
    finally:
        crash.stop()
