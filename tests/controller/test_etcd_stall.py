"""An etcd stalled past the leader's lease ttl (SIGSTOP, then SIGCONT): the controller steps down and
campaigns again in-process instead of exiting, leads again, and resolves the next incident; the dc_manager
rides the stall out too. Its own etcd (not the session's): stopping that one would stall every test."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState, incident_id_for
from tests.controller.helpers import control_plane, service_env, serving_cluster, wait_for


async def _resolved(store: Store, inc_id: str) -> IncidentRecord | None:
    rec = await store.get_model(f"incidents/{inc_id}", IncidentRecord)
    return rec if rec is not None and rec.state is IncidentState.RESOLVED else None


async def test_a_controller_outlives_an_etcd_stall_past_its_lease_and_leads_again(
        bus: Bus, stall_store: Store, stall_settings: CommonSettings, own_etcd: procs.Child, tmp_path: Path) -> None:
    store = stall_store
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2)
    env = service_env(stall_settings.to_env(), HF_LEADER_TTL_S="1")
    async with control_plane(bus, store, env, tmp_path) as children:
        first = sim.engine_id("n0000", 0)
        await sim.fail(first)
        first_id = incident_id_for(first, sim.engines[first].generation)
        await wait_for(lambda: _resolved(store, first_id), what="an incident resolved before the stall")

        os.kill(own_etcd.pid, signal.SIGSTOP)  # etcd frozen: no lease refresh, no read, no write
        await asyncio.sleep(6.0)  # six ttls
        os.kill(own_etcd.pid, signal.SIGCONT)  # etcd expires the leader's lease at once

        # The old lease is gone for good: a leader key again means the controller campaigned anew in-process.
        async def leads_again() -> bool:
            raw, _ = await store.get_with_revision("leader/controller")
            return raw == b"c1" and children["c1"].alive()

        await asyncio.sleep(3.0)  # past the moment the expired lease is noticed
        assert children["c1"].alive(), f"controller exited with {children['c1'].returncode}"
        await wait_for(leads_again, timeout=30, what="the controller leading again")
        second = sim.engine_id("n0000", 1)
        await sim.fail(second)
        second_id = incident_id_for(second, sim.engines[second].generation)
        await wait_for(lambda: _resolved(store, second_id), timeout=30, what="an incident resolved after the stall")
        assert children["c1"].alive() and children["dcm"].alive()
        log = (tmp_path / "c1.log").read_text()
        assert "stepping down" in log, log[-3000:]
