"""The dc_manager SIGSTOPped in the middle of a takeover, for longer than the controller's reattach deadline (a
paused VM): the controller falls back to a cold start meanwhile; the takeover's reply and the fallback's intent wait
in the stopped process. Once it runs again, the incident ends once, and one engine serves in the failed one's place:
the late takeover's successor or the cold engine, the other one stopped."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.store import Store
from services.controller.incident import IncidentRecord, incident_id_for
from tests.controller.helpers import collected, control_plane, service_env, serving_cluster, wait_for


async def _ended(store: Store, inc_id: str) -> IncidentRecord | None:
    rec = await store.get_model(f"incidents/{inc_id}", IncidentRecord)
    return rec if rec is not None and rec.terminal else None


async def test_a_dc_manager_stopped_past_the_reattach_deadline_leaves_one_engine_in_the_failed_ones_place(
        bus: Bus, store: Store, settings: CommonSettings, tmp_path: Path) -> None:
    gate = asyncio.Event()
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2, takeover_gate=gate)
    ends = await collected(bus, "incident.resolved", "incident.failed")
    env = service_env(settings.to_env(), HF_REATTACH_DEADLINE_S="4")
    async with control_plane(bus, store, env, tmp_path) as children:
        victim = sim.engine_id("n0000", 0)
        await sim.fail(victim)
        inc_id = incident_id_for(victim, sim.engines[victim].generation)
        await wait_for(lambda: asyncio.sleep(0, sim.takeover_started.is_set()), what="the takeover started")
        await asyncio.sleep(1.0)  # the freeze result is out: the controller waits for the reattach
        dcm = children["dcm"]
        os.kill(dcm.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.5)
            gate.set()  # the takeover's reply waits in the stopped dc_manager's socket
            await asyncio.sleep(8.0)  # past the reattach deadline: the fallback's intent waits in the stream
        finally:
            os.kill(dcm.pid, signal.SIGCONT)
        rec = await wait_for(lambda: _ended(store, inc_id), timeout=30, what="the incident ended")
        await asyncio.sleep(4.0)  # whatever the late steps still do
        mine = [e for e in ends if e.incident_id == inc_id]
        assert len(mine) == 1, mine
        successor = f"{victim}-s{sim.engines[victim].generation + 1}"
        in_place = [eid for eid, info in sim.engines.items()
                    if eid != victim and info.state != "stopped" and (eid == successor or eid.startswith("cs-"))]
        endpoints = sorted((await store.get_prefix("endpoints/")).keys())
        print("rec", rec.state, rec.successor_id, "in place", in_place, "stopped", sim.stopped, "endpoints", endpoints)
        assert len(in_place) == 1, (in_place, sim.stopped)
        assert rec.successor_id == in_place[0]
        assert dcm.alive()
