"""A routed engine's first fault is routed out and dispatched while its incident's create is in flight
(pipeline.py `_dispatch_first`): the opening's etcd commit is off the way to the successor. Shown with etcd
stopped (SIGSTOP) right before the fault: the route-out and the intent go out during the stall, and the incident
is opened (one record) and resolved once etcd runs again. With `dispatch_before_create` off, nothing goes out
before the create is confirmed. Its own etcd (not the session's): stopping that one would stall every test."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import Envelope, FaultKind
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState, incident_id_for
from tests.controller.helpers import collected, control_plane, service_env, serving_cluster, wait_for

STALL_S = 2.0


async def _removed(seen: list[Envelope], engine_id: str) -> bool:
    return any(env.type == "router.endpoint.removed" and env.data.engine_id == engine_id for env in seen)


async def _resolved(store: Store, inc_id: str) -> IncidentRecord | None:
    rec = await store.get_model(f"incidents/{inc_id}", IncidentRecord)
    return rec if rec is not None and rec.state is IncidentState.RESOLVED else None


@pytest.mark.parametrize(("first", "kind"), [(True, FaultKind.KILLED), (False, FaultKind.KILLED),
                                              (True, FaultKind.GPU_FAULT)],
                         ids=["dispatched-first", "created-first", "memory-lost-created-first"])
async def test_a_routed_engines_fault_is_dispatched_while_etcd_stalls_and_opened_after(
        first: bool, kind: FaultKind, bus: Bus, stall_store: Store, stall_settings: CommonSettings,
        own_etcd: procs.Child, tmp_path: Path) -> None:
    """A killed engine's fault goes out during the stall; with the setting off, or a lost memory's (a cold start,
    seconds anyway), nothing goes out before the create is confirmed."""
    store = stall_store
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2)
    env = service_env(stall_settings.to_env(), HF_LEADER_TTL_S="15",
                      HF_DISPATCH_BEFORE_CREATE="true" if first else "false")
    async with control_plane(bus, store, env, tmp_path) as children:
        warm = sim.engine_id("n0000", 0)  # one incident end to end first: every connection is up and used
        await sim.fail(warm)
        await wait_for(lambda: _resolved(store, incident_id_for(warm, sim.engines[warm].generation)),
                       what="an incident resolved before the stall")

        victim = sim.engine_id("n0000", 1)
        inc_id = incident_id_for(victim, sim.engines[victim].generation)
        seen = await collected(bus, "router.endpoint.removed", "intent.recover")
        os.kill(own_etcd.pid, signal.SIGSTOP)  # no create can be confirmed now
        try:
            await sim.fail(victim, kind)
            await asyncio.sleep(STALL_S)
            during = [(env.type, getattr(env.data, "engine_id", None)) for env in seen]
        finally:
            os.kill(own_etcd.pid, signal.SIGCONT)
        mine = [t for t, engine in during if engine == victim]
        if first and not kind.loses_memory:
            assert sorted(mine) == ["intent.recover", "router.endpoint.removed"], during
        else:
            assert mine == [], during
        if kind.loses_memory:  # the cold start's own way is not this test's: dispatched once the create is in
            await wait_for(lambda: _removed(seen, victim), timeout=30, what="the route-out after the stall")
            return
        rec = await wait_for(lambda: _resolved(store, inc_id), timeout=30, what="the incident resolved after the stall")
        assert rec.successor_id, rec
        records = [k for k in await store.get_prefix("incidents/") if victim in k]
        assert records == [f"incidents/{inc_id}"], records  # one incident for that generation
        removed = [env for env in seen if env.type == "router.endpoint.removed" and env.data.engine_id == victim]
        assert len(removed) == 1, removed  # dispatched once: the create's confirmation redid nothing
        assert children["c1"].alive() and children["dcm"].alive()
