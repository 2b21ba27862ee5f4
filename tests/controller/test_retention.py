"""Ended incidents' records leave etcd after their retention (libs/common/retention.py): the policy
alone, then a real controller and dc_manager deleting a resolved record while an open incident's stays, and a
late copy of a pruned incident's fault opening nothing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from libs.common.bus import Bus
from libs.common.events import EndpointRemoved
from libs.common.retention import Retention, due, prune_once
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState, incident_id_for
from tests.controller.helpers import control_plane, service_env, serving_cluster, wait_for

POLICY = Retention(keep_s=100.0, keep_max=3, min_s=10.0, per_pass=10)


def test_records_older_than_the_retention_go_oldest_first() -> None:
    ended = {"a": 0.0, "b": 50.0, "c": 95.0}
    assert due(ended, 120.0, POLICY) == ["a"]  # 120 and 70 old; only "a" is past 100 s
    assert due(ended, 200.0, POLICY) == ["a", "b", "c"]


def test_past_the_count_cap_the_oldest_go_early_but_never_a_young_one() -> None:
    ended = {f"i{n}": float(n) for n in range(6)}  # 6 ended, 3 kept at most
    assert due(ended, 11.5, POLICY) == ["i0", "i1"]  # i2..i5 ended less than 10 s ago: kept for now
    assert due(ended, 20.0, POLICY) == ["i0", "i1", "i2"]  # the 3 oldest: 3 left
    assert due(ended, 20.0, Retention(keep_s=100.0, keep_max=3, min_s=10.0, per_pass=2)) == ["i0", "i1"]


def test_an_entry_out_of_order_waits_for_the_older_ones() -> None:
    assert due({"young": 95.0, "old": 0.0}, 120.0, POLICY) == []


async def _record(store: Store, inc_id: str) -> IncidentRecord | None:
    return await store.get_model(f"incidents/{inc_id}", IncidentRecord)


async def test_a_resolved_record_is_deleted_an_open_one_is_kept_and_a_late_fault_opens_nothing(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    gate = asyncio.Event()
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2, takeover_gate=gate)
    env = service_env(settings_env, HF_INCIDENT_RETENTION_S="0.5", HF_INCIDENT_RETENTION_MIN_S="0",
                      HF_INCIDENT_RETENTION_CHECK_S="0.1")
    async with control_plane(bus, store, env, tmp_path):
        first, second = sim.engine_id("n0000", 0), sim.engine_id("n0000", 1)
        stale = sim.fault(first)  # the fault of the first incident, published once more below
        await bus.publish(stale)
        first_id = incident_id_for(first, sim.engines[first].generation)
        gate.set()
        await wait_for(lambda: _state(store, first_id, IncidentState.RESOLVED), what="the first incident resolved")
        gate.clear()  # the second incident stays open (its takeover held)
        await sim.fail(second)
        second_id = incident_id_for(second, sim.engines[second].generation)
        await wait_for(lambda: _record(store, second_id), what="the second incident opened")

        await wait_for(lambda: _gone(store, first_id), timeout=20, what="the resolved record deleted")
        await asyncio.sleep(1.0)  # two retention windows: the open one must still be there
        open_rec = await _record(store, second_id)
        assert open_rec is not None and not open_rec.terminal

        # A late copy of the first fault (a redelivery, another id): nothing reopens it.
        await bus.publish(sim.fault(first).model_copy(update={"data": stale.data}))
        gate.set()
        await wait_for(lambda: _state(store, second_id, IncidentState.RESOLVED), what="the second incident resolved")
        await sim.fail(f"{second}-s1")  # handled after the late copy (one consumer, in order): a barrier
        third_id = incident_id_for(f"{second}-s1", sim.engines[f"{second}-s1"].generation)
        await wait_for(lambda: _state(store, third_id, IncidentState.RESOLVED), what="a third incident resolved")
        removed = [e.data for e in await bus.replay("router.endpoint.removed") if isinstance(e.data, EndpointRemoved)]
        assert [r.engine_id for r in removed].count(first) == 1  # routed out once: no second incident
        assert await _record(store, first_id) is None


async def _state(store: Store, inc_id: str, state: IncidentState) -> IncidentRecord | None:
    rec = await _record(store, inc_id)
    return rec if rec is not None and rec.state is state else None


async def _gone(store: Store, inc_id: str) -> bool:
    return await store.get(f"incidents/{inc_id}") is None


async def test_a_backlog_larger_than_a_chunk_is_deleted_in_one_pass() -> None:
    ended = {f"i{n}": 0.0 for n in range(25)}
    ended["young"] = time.time()
    deleted: list[str] = []
    assert await prune_once(ended, deleted.append, Retention(keep_s=60.0, keep_max=0, min_s=30.0, per_pass=10)) == 25
    assert deleted == [f"i{n}" for n in range(25)] and list(ended) == ["young"]
