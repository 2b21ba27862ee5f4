"""The incident pipeline end to end: real controller and dc_manager processes, real NATS and etcd, the node
side simulated in the test by real NATS responders (bench.controlplane.SimulatedCluster)."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

from devstack.simcluster import SimulatedCluster
from libs.common.bus import Bus
from libs.common.events import EndpointAdded, EndpointRemoved, Envelope, FaultKind, IncidentResolved
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState
from tests.controller.helpers import control_plane, service_env, serving_cluster, span_sink, wait_for


async def _record(store: Store, inc_id: str) -> IncidentRecord | None:
    return await store.get_model(f"incidents/{inc_id}", IncidentRecord)


async def _events(bus: Bus, subject: str) -> asyncio.Queue[Envelope]:
    q: asyncio.Queue[Envelope] = asyncio.Queue()

    async def put(env: Envelope) -> None:
        await q.put(env)

    await bus.subscribe(subject, put)
    return q


async def test_a_killed_engine_is_routed_out_reattached_and_routed_in_in_one_trace(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = SimulatedCluster(bus, store, nodes=2, gpus_per_node=2)
    await sim.populate()
    await sim.serve()
    removed = await _events(bus, "router.endpoint.removed")
    added = await _events(bus, "router.endpoint.added")
    with span_sink() as (sink, endpoint):
        env = service_env(settings_env, HF_OTEL_ENDPOINT=endpoint)
        async with control_plane(bus, store, env, tmp_path):
            victim = sim.engine_id("n0000", 1)
            await sim.fail(victim)
            out = await asyncio.wait_for(removed.get(), 20)
            assert isinstance(out.data, EndpointRemoved) and out.data.engine_id == victim
            assert out.data.recovery and not out.data.live  # a failed engine: its streams are cut at once
            got = await asyncio.wait_for(added.get(), 20)
            assert isinstance(got.data, EndpointAdded)
            assert got.data.predecessor_id == victim and got.data.engine_id == f"{victim}-s1"
            inc_id = got.data.incident_id
            assert inc_id is not None
            rec = await wait_for(lambda: _resolved(store, inc_id), what="resolved")
            assert rec.successor_id == f"{victim}-s1" and not rec.fallback
            assert set(rec.timings_ms()) >= {"detect", "freeze", "route_out", "reattach", "route_in", "total"}
            assert await store.get(f"endpoints/m/{victim}") is None
            assert (await store.get(f"endpoints/m/{victim}-s1")) is not None
            resolved = [e for e in await bus.replay("incident.resolved") if isinstance(e.data, IncidentResolved)]
            assert len(resolved) == 1 and resolved[0].data.total_ms > 0  # type: ignore[union-attr]
        assert rec.trace_parent is not None
        trace_id = rec.trace_parent.split("-")[1]
        spans = await wait_for(lambda: _spans_with(sink, trace_id, 8), what="spans exported")
        names = {s["name"] for s in spans}
        assert {"step detect", "step freeze", "step route_out", "step reattach", "step route_in"} <= names
        assert {"dc_manager.freeze", "dc_manager.reattach"} <= names  # the dc_manager's spans join the trace
        assert {s["service"] for s in spans} >= {"holdfast.controller", "holdfast.dc_manager"}


async def _absent(store: Store, key: str) -> bool:
    return await store.get(key) is None


async def _resolved(store: Store, inc_id: str) -> IncidentRecord | None:
    rec = await _record(store, inc_id)
    return rec if rec is not None and rec.state is IncidentState.RESOLVED else None


async def _spans_with(sink: object, trace_id: str, n: int) -> list[dict[str, object]] | None:
    spans = sink.in_trace(trace_id)  # type: ignore[attr-defined]
    return spans if len(spans) >= n else None


async def test_a_controller_killed_between_freeze_and_reattach_is_replaced_and_the_incident_finishes_once(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=2)
    sim.takeover_gate = asyncio.Event()
    await sim.populate()
    await sim.serve()
    env = service_env(settings_env, HF_LEADER_TTL_S="1", HF_REATTACH_DEADLINE_S="60", HF_ACK_WAIT_S="1")
    async with control_plane(bus, store, env, tmp_path, controllers=("c1", "c2")) as procs:
        assert (await store.get("leader/controller")) == b"c1"
        victim = sim.engine_id("n0000", 0)
        await sim.fail(victim)
        inc_id = f"inc-{victim}-g0"

        async def reattaching() -> IncidentRecord | None:
            rec = await _record(store, inc_id)
            return rec if rec is not None and rec.state is IncidentState.REATTACHING else None

        await wait_for(reattaching, what="the freeze recorded")
        await asyncio.wait_for(sim.takeover_started.wait(), 10)
        procs["c1"].kill(signal.SIGKILL)
        await wait_for(lambda: _leader_is(store, b"c2"), what="c2 takes over")
        sim.takeover_gate.set()
        rec = await wait_for(lambda: _resolved(store, inc_id), what="resolved by c2")
        assert rec.leader == "c2" and rec.successor_id == f"{victim}-s1"
        await asyncio.sleep(1.5)  # room for any duplicate to show up
        assert len(sim.takeovers) == 1  # exactly one takeover happened
        resolved = [e for e in await bus.replay("incident.resolved") if e.incident_id == inc_id]
        added = [e for e in await bus.replay("router.endpoint.added") if e.incident_id == inc_id]
        assert len(resolved) == 1 and len(added) == 1


async def _leader_is(store: Store, who: bytes) -> bool:
    return (await store.get("leader/controller")) == who


async def test_a_gpu_fault_takes_the_cold_start_fallback(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = await serving_cluster(bus, store, nodes=2, gpus_per_node=1)
    await store.put("gpus/n0000/0", {"healthy": False, "total_bytes": sim.gpu_bytes})
    async with control_plane(bus, store, service_env(settings_env), tmp_path):
        victim = sim.engine_id("n0000", 0)
        await sim.fail(victim, FaultKind.GPU_FAULT)
        inc_id = f"inc-{victim}-g0"
        rec = await wait_for(lambda: _resolved(store, inc_id), what="resolved by a cold start")
        assert rec.fallback and rec.memory_lost and sim.spawn_calls == 1 and sim.freeze_calls == 0
        assert rec.successor_id == f"cs-{inc_id}"


async def test_a_missed_freeze_deadline_falls_back_and_fails_without_a_spec(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=1)
    await sim.populate()  # no responders at all: the node never answers the freeze
    env = service_env(settings_env, HF_FREEZE_DEADLINE_S="0.5", HF_FREEZE_TIMEOUT_S="0.2", HF_RETRIES="1")
    async with control_plane(bus, store, env, tmp_path):
        victim = sim.engine_id("n0000", 0)
        await sim.fail(victim)
        inc_id = f"inc-{victim}-g0"

        async def failed() -> IncidentRecord | None:
            rec = await _record(store, inc_id)
            return rec if rec is not None and rec.state is IncidentState.FAILED else None

        rec = await wait_for(failed, what="failed")
        assert rec.fallback and "no engine spec" in (rec.steps["fallback"].detail or "")
        assert rec.steps["freeze"].status == "failed"
        await wait_for(lambda: _absent(store, f"recoveries/{inc_id}"), what="the record gone at the failed end")


async def test_a_cold_started_engine_is_routed_in_only_once_it_reports_ready(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    # the cold engine stays "loading its weights" until its gate is set
    sim = await serving_cluster(bus, store, nodes=2, gpus_per_node=1, ready_gate=asyncio.Event())
    async with control_plane(bus, store, service_env(settings_env), tmp_path):
        victim = sim.engine_id("n0000", 0)
        await sim.fail(victim, FaultKind.GPU_FAULT)
        inc_id = f"inc-{victim}-g0"

        async def spawned() -> IncidentRecord | None:
            rec = await _record(store, inc_id)
            return rec if rec is not None and rec.cold_successor_id else None

        rec = await wait_for(spawned, what="the cold start answered")
        assert rec.state is IncidentState.FALLBACK and rec.successor_id is None
        assert not [e for e in await bus.replay("router.endpoint.added") if e.incident_id == inc_id]
        # the recovery is in etcd while the successor starts: a router starting now holds the model (router sync.py)
        marker = await wait_for(lambda: store.get(f"recoveries/{inc_id}"), what="the recovery's record")
        assert json.loads(marker)["model"] == "m"
        sim.ready_gate.set()
        rec = await wait_for(lambda: _resolved(store, inc_id), what="routed in once ready")
        await wait_for(lambda: _absent(store, f"recoveries/{inc_id}"), what="the record gone with the route-in")
        assert rec.successor_id == f"cs-{inc_id}"
        assert rec.steps["fallback"].ended_at is not None
        added = [e for e in await bus.replay("router.endpoint.added") if e.incident_id == inc_id]
        assert len(added) == 1 and added[0].data.engine_id == f"cs-{inc_id}"


async def test_a_reattach_that_succeeds_after_the_fallback_began_wins_and_the_cold_engine_is_stopped(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    # the takeover is slow (the reattach deadline passes first) and the cold engine is still loading when it lands
    sim = await serving_cluster(bus, store, nodes=2, gpus_per_node=1, takeover_gate=asyncio.Event(),
                                ready_gate=asyncio.Event())
    env = service_env(settings_env, HF_REATTACH_DEADLINE_S="0.5")
    async with control_plane(bus, store, env, tmp_path):
        victim = sim.engine_id("n0000", 0)
        await sim.fail(victim)
        inc_id = f"inc-{victim}-g0"

        async def cold_started() -> IncidentRecord | None:
            rec = await _record(store, inc_id)
            return rec if rec is not None and rec.cold_successor_id else None

        rec = await wait_for(cold_started, what="the fallback's engine spawned")
        assert rec.state is IncidentState.FALLBACK
        sim.takeover_gate.set()
        rec = await wait_for(lambda: _resolved(store, inc_id), what="resolved by the late reattach")
        assert rec.successor_id == f"{victim}-s1" and rec.cold_stopped
        assert rec.steps["fallback"].status == "skipped" and rec.steps["reattach"].status == "done"
        await wait_for(lambda: _true(f"cs-{inc_id}" in sim.stopped), what="the cold engine stopped")
        sim.ready_gate.set()  # it would be ready now: it must not be routed in
        await asyncio.sleep(0.5)
        added = [e for e in await bus.replay("router.endpoint.added") if e.incident_id == inc_id]
        assert [e.data.engine_id for e in added] == [f"{victim}-s1"]
        assert (await store.get(f"endpoints/m/cs-{inc_id}")) is None


async def _true(value: bool) -> bool:
    return value
