"""`holdfast up --ha` under fire: the stack of 3 etcd members, 3 NATS servers, 3 nodes, 2 controllers, 2
dc_managers and a router; an engine is killed twice, the first time with the leading controller and an etcd
member, the second with a NATS server. Each incident resolves exactly once, no lease is lost or written by two
engines, and the successor serves its memory intact."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.chaos_checks import IncidentTracker
from bench.chaos_faults import EngineScan
from bench.chaos_run import lease_writers
from devstack.stack import HA_NODES, Stack, StackConfig
from libs.common.bus import Bus
from libs.common.events import EngineInfo, EngineSpec, Envelope, LeaseState, ListLeases, ListLeasesReply
from libs.common.store import Store

MODEL = "ha-m"


def pattern_engines(path: Path) -> Path:
    spec = EngineSpec(engine_class="pattern", model=MODEL, command=[sys.executable, "-m", "engines.pattern"],
                      env={"HF_PATTERN_BYTES": str(4 << 20), "HF_PATTERN_HEARTBEAT_S": "0.05"}, replicas=1,
                      standbys=1, cold_start_s=20.0)
    path.write_text(json.dumps([spec.model_dump(mode="json")]))
    return path


class Watch:
    """What the test samples while it runs: terminal events, incident records, writers of each lease."""

    def __init__(self, stack: Stack, store: Store) -> None:
        self.stack, self.store = stack, store
        # Two trackers: the controller announces an end before its write-behind record lands, so a record read
        # just after the event can still show the step before: only a record read ended in etcd and read open
        # after that is a reopening (`records`); how each incident ended is what was heard (`heard`).
        self.tracker = IncidentTracker()
        self.heard = IncidentTracker()
        self.records: dict[str, dict[str, Any]] = {}
        self.two_writers: list[dict[str, set[int]]] = []

    async def on_terminal(self, env: Envelope) -> None:
        assert env.incident_id is not None
        self.heard.heard(env.incident_id, env.type.removeprefix("incident."), env.id, time.monotonic())

    async def sample(self) -> None:
        scan = EngineScan(self.stack.base_dir / "state" / HA_NODES[0])  # keeps what it learnt between samples
        while True:
            try:
                raw = await self.store.get_prefix("incidents/")
                recs = [json.loads(v) for v in raw.values()]
                self.tracker.snapshot(recs)
                self.records.update({r["id"]: r for r in recs})
            except Exception:  # noqa: BLE001 - an etcd member just died: the next sample reads another
                pass
            writers = await asyncio.to_thread(lease_writers, scan)
            if any(len(pids) > 1 for pids in writers.values()):
                self.two_writers.append(writers)
            await asyncio.sleep(0.1)

    async def engines(self) -> list[EngineInfo]:
        return [EngineInfo.model_validate_json(v) for v in (await self.store.get_prefix("engines/")).values()]

    async def serving(self, timeout: float = 60.0) -> EngineInfo:
        """The active engine once it is ready, routed, and a standby waits beside it."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                engines = await self.engines()
                routed = await self.store.get_prefix(f"endpoints/{MODEL}/")
            except Exception:  # noqa: BLE001 - failing over
                engines, routed = [], {}
            active = [e for e in engines if e.role == "active" and e.state == "ready"]
            standby = [e for e in engines if e.role == "standby" and e.state in ("standby", "ready")]
            if len(active) == 1 and standby and any(active[0].engine_id in k for k in routed):
                return active[0]
            assert time.monotonic() < deadline, f"not serving: {[(e.engine_id, e.role, e.state) for e in engines]}"
            await asyncio.sleep(0.1)

    async def ended(self, engine_id: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            mine = [r for r in self.records.values() if r["engine_id"] == engine_id]
            if mine and all(r["state"] in ("resolved", "failed") for r in mine):
                assert len(mine) == 1, mine
                return mine[0]
            assert time.monotonic() < deadline, f"incident of {engine_id} not ended: {mine}"
            await asyncio.sleep(0.1)


async def leader_child(store: Store) -> str:
    raw = await store.get("leader/controller")
    assert raw is not None
    return raw.decode()  # the instance, which is the child's name (controller-1, controller-2)


async def checksum(endpoint: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as c:
        return dict((await c.get(f"{endpoint}/checksum", timeout=10)).json())


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_incidents_resolve_once_while_an_etcd_member_a_nats_server_and_the_leader_die(tmp_path: Path) -> None:
    stack = Stack(StackConfig.ephemeral(ha=True, backend="host", base_dir=tmp_path / "stack",
                                        engines_file=pattern_engines(tmp_path / "engines.json")))
    try:
        await asyncio.to_thread(stack.start, 120.0)
        settings = stack.settings()
        store = await Store.connect(settings)
        bus = await Bus.connect(settings, "ha-test", stream=False)
        w = Watch(stack, store)
        for subject in ("incident.resolved", "incident.failed"):
            await bus.subscribe(subject, w.on_terminal)
        sampler = asyncio.create_task(w.sample())
        first = await w.serving()
        before = await checksum(first.endpoint or "")

        # Incident 1: the leading controller, the first etcd member (the one every client picks) and the engine.
        leader = await leader_child(store)
        for name in (leader, "etcd-0"):
            stack.kill(name)
        os.kill(first.pid or 0, signal.SIGKILL)
        rec1 = await w.ended(first.engine_id)
        second = await w.serving()
        assert await leader_child(store) != leader

        # Incident 2: a NATS server and the successor.
        stack.kill("nats-0")
        os.kill(second.pid or 0, signal.SIGKILL)
        rec2 = await w.ended(second.engine_id)
        third = await w.serving()
        after = await checksum(third.endpoint or "")

        await asyncio.sleep(0.5)  # a late duplicate or reopening would show in the next samples
        sampler.cancel()
        assert (rec1["state"], rec2["state"]) == ("resolved", "resolved"), (rec1, rec2)
        assert not w.tracker.unresolved() and not w.tracker.failed()  # as etcd holds them at the end
        assert not w.heard.failed() and not w.heard.ended_both_ways()
        assert not w.tracker.reopened and not w.two_writers, (w.tracker.reopened, w.two_writers)
        assert after["pattern_ok"] and after["sha256"] == before["sha256"] and after["bytes"] == before["bytes"]
        leases = (await bus.request(HA_NODES[0], ListLeases(), ListLeasesReply, timeout=5)).leases
        held = [le for le in leases if le.owner == third.engine_id]
        assert held and all(le.state == LeaseState.ACTIVE for le in held), leases
        assert not [le for le in leases if le.state == LeaseState.ORPHANED], leases
        await bus.close()
        await store.close()
    finally:
        await asyncio.to_thread(stack.stop)


def test_an_ha_stack_runs_each_node_its_own_pair_and_two_of_the_cluster_side() -> None:
    from devstack.stack import ha_instances

    insts = ha_instances(HA_NODES, 9001, Path("/s"))
    assert len({i.name for i in insts}) == len(insts)
    for node in HA_NODES:
        pair = [i for i in insts if i.instance == node]
        assert sorted(i.service for i in pair) == ["agent", "gpu_manager"]
        assert all(dict(i.env) == {"HF_NODE": node, "HF_STATE_DIR": f"/s/{node}"} for i in pair)
    controllers = [dict(i.env) for i in insts if i.service == "controller"]
    assert [c["HF_INSTANCE"] for c in controllers] == ["controller-1", "controller-2"]
    assert [c.get("HF_API_PORT") for c in controllers] == [None, "9001"]
    assert [i.service for i in insts].count("dc_manager") == 2 and insts[-1].service == "router"
