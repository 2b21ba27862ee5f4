"""A leading controller SIGSTOPped past its lease while an incident is in flight (a paused VM, a swap storm):
the other controller takes the incident over and resolves it; when the old leader resumes, with the incident's
deadline long past in the table it kept, it must not act on its stale leadership (no fallback intent, no cold
start beside the successor, no second end): it finds its lease gone and steps down."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.store import LeaderElection, Store
from services.controller.incident import IncidentRecord, IncidentState, incident_id_for
from tests.controller.helpers import collected, control_plane, service_env, serving_cluster, wait_for

DEADLINE_S = 12  # freeze and reattach: c2 resolves well inside them, c1 resumes well past them


async def _leader(store: Store) -> str | None:
    raw = await store.get("leader/controller")
    return raw.decode() if raw else None


async def _record(store: Store, inc_id: str) -> IncidentRecord | None:
    return await store.get_model(f"incidents/{inc_id}", IncidentRecord)


async def test_a_resumed_stale_leader_does_not_drive_the_incident_its_successor_resolved(
        bus: Bus, store: Store, settings: CommonSettings, tmp_path: Path) -> None:
    gate = asyncio.Event()
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2, takeover_gate=gate)
    seen = await collected(bus, "incident.resolved", "incident.failed", "intent.recover")
    env = service_env(settings.to_env(), HF_LEADER_TTL_S="1", HF_REATTACH_DEADLINE_S=str(DEADLINE_S),
                      HF_FREEZE_DEADLINE_S=str(DEADLINE_S), HF_FREEZE_RESULT_AFTER_S="0.2")
    async with control_plane(bus, store, env, tmp_path, controllers=("c1", "c2")) as children:
        assert await _leader(store) == "c1"
        victim = sim.engine_id("n0000", 0)
        await sim.fail(victim)
        failed_at = time.monotonic()
        inc_id = incident_id_for(victim, sim.engines[victim].generation)
        await wait_for(lambda: asyncio.sleep(0, sim.takeover_started.is_set()), what="the takeover started")
        await asyncio.sleep(1.5)  # c1 holds the incident in its table, waiting for the reattach

        c1 = children["c1"]
        os.kill(c1.pid, signal.SIGSTOP)
        try:
            await wait_for(lambda: _is(store, "c2"), timeout=20,
                           what="c2 leading")
            await asyncio.sleep(6.0)  # c1's pull requests expired: the result can only go to c2
            assert time.monotonic() - failed_at < DEADLINE_S - 1, "too slow a machine for this test's deadlines"
            gate.set()
            rec = await wait_for(lambda: _ended(store, inc_id), timeout=20, what="c2 ended the incident")
            assert rec.state is IncidentState.RESOLVED, rec
            # c1 stays stopped until the incident's deadlines are well past in the table it kept.
            await asyncio.sleep(max(0.0, failed_at + DEADLINE_S + 2.5 - time.monotonic()))
        finally:
            os.kill(c1.pid, signal.SIGCONT)
        await wait_for(lambda: _stepped_down(tmp_path / "c1.log"), timeout=20, what="c1 stepping down")
        await asyncio.sleep(3.0)
        rec = await _record(store, inc_id)
        assert rec is not None and rec.state is IncidentState.RESOLVED, rec
        kinds = [(e.type, getattr(e.data, "memory_lost", None)) for e in seen if e.incident_id == inc_id]
        print("events", kinds, "spawns", sim.spawn_calls)
        assert sim.spawn_calls == 0, "a cold start beside the successor"
        assert [k for k in kinds if k[0] != "intent.recover"] == [("incident.resolved", None)], kinds
        assert all(k == ("intent.recover", False) for k in kinds if k[0] == "intent.recover"), kinds
        assert c1.alive() and children["c2"].alive()


async def _is(store: Store, who: str) -> bool:
    return await _leader(store) == who


async def _ended(store: Store, inc_id: str) -> IncidentRecord | None:
    rec = await _record(store, inc_id)
    return rec if rec is not None and rec.terminal else None


async def _stepped_down(log: Path) -> bool:
    return "stepping down" in log.read_text()


async def test_a_leader_holds_only_while_a_refresh_confirmed_its_lease_within_the_ttl(store: Store) -> None:
    election = LeaderElection(store, "confirmed", "me", ttl=2)
    await election.campaign()
    try:
        assert election.holds()
        assert election.keepalive is not None
        election.keepalive.stop()  # as a process stopped: no refresh goes out, and none says the lease is lost
        await asyncio.sleep(2.3)
        assert not election.keepalive.lost.is_set()
        assert not election.holds()  # etcd may have expired it by now: another may lead
        assert not await election.confirm(0.3)
    finally:
        await election.resign()
    assert not election.holds()
