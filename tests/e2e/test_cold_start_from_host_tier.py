"""A cold start restores from the fastest copy that exists (issue 21): the real stack on the host backend (nats, etcd,
gpu_manager with its keeper and a host tier, agent, controller, dc_manager, router), one reference engine, no
standby. Its weights lease is copied into the node's host tier by policy; then its memory is lost (its leases
force-reclaimed while it is stopped) and it is SIGKILLed. The incident's fallback cold-starts a new engine, which
loads its weights from the host copy with the weights file renamed away (a read of it would fail), serves the same
greedy outputs, and the incident's timeline says which copy served and how long the load took."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from devstack.scenario import MODEL, Scenario, engine_command
from devstack.stack import Stack, StackConfig
from libs.common.events import (
    EngineInfo,
    EngineSpec,
    ListLeases,
    ListLeasesReply,
    Reclaim,
    ReclaimReply,
    Step,
)
from services.controller.incident import IncidentRecord, IncidentState
from tests.e2e.test_tp_incident import greedy
from tests.engine.support import make_tiny_weights


class HostTierScenario(Scenario):
    """The demo scenario with one engine on leased memory, no standby, and a host tier keeping its class's weights."""

    def start(self) -> Stack:
        make_tiny_weights(self.weights)
        spec = EngineSpec(engine_class="reference", model=MODEL, command=engine_command(self.weights, self.size),
                          replicas=1, standbys=0, cold_start_s=30.0, env={"HF_ENGINE_MEMORY": "leased"})
        self.stack = Stack(StackConfig.ephemeral(
            base_dir=self.work_dir / "stack", backend="host", engines_file=self.write_specs(spec),
            extra_env={"HF_HOST_TIER_CLASSES": json.dumps(["reference"]), "HF_HOST_TIER_BYTES": str(1 << 30)}))
        self.stack.start(timeout=120)
        return self.stack


async def until(check, what: str, timeout: float = 60.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while not (got := await check()):
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        await asyncio.sleep(0.1)
    return got


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_a_lost_engines_cold_start_loads_from_the_host_tier_without_reading_the_file(tmp_path: Path) -> None:
    sc = HostTierScenario(size="tiny", backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    try:
        await asyncio.to_thread(sc.start)
        await sc.connect()
        assert sc.bus is not None and sc.store is not None and sc.stack is not None
        node = sc.stack.config.node
        first = await sc.wait_serving(standbys=0, timeout=180)
        assert (await sc.engine_health(first.endpoint or ""))["memory"]["weights"]["source"] == "file"

        async def tiered() -> bool:  # the copy the gpu_manager publishes for placement: the closest one, so while
            # the engine runs its lease, hashed by the tier copy's write, is published as a peer (docs/restore.md)
            rec = json.loads((await sc.store.get(f"gpus/{node}/0")) or "{}")
            return (rec.get("copies") or {}).get("reference.weights") in ("host", "peer")
        await until(tiered, "host tier copy of reference.weights")
        async with httpx.AsyncClient() as client:
            before = await greedy(sc, client)
            sc.weights.rename(sc.weights.with_suffix(".gone"))  # from here, a read of the file fails
            assert first.pid is not None
            os.kill(first.pid, signal.SIGSTOP)  # it cannot act on losing its leases; then it is killed
            leases = (await sc.bus.request(node, ListLeases(), ListLeasesReply, timeout=5)).leases
            for lease in [x for x in leases if x.owner == first.engine_id]:
                await sc.bus.request(node, Reclaim(lease_id=lease.id, force=True), ReclaimReply, timeout=5)
            seen = len(sc.events)
            os.kill(first.pid, signal.SIGKILL)
            resolved = await sc.wait_event("incident.resolved", 180, after=seen)
            successor = await until(lambda: ready_successor(sc, first), "ready successor")
            after = await greedy(sc, client)
            health = await sc.engine_health(successor.endpoint or "")
        assert after == before
        weights = health["memory"]["weights"]
        assert weights["source"] == "host" and weights["restore"]["bytes"] > 0 and weights["load_ms"] > 0
        assert successor.weights is not None and successor.weights.source == "host"  # in its etcd record
        inc = IncidentRecord.model_validate_json(await sc.store.get(f"incidents/{resolved.data.incident_id}"))  # type: ignore[attr-defined]
        assert inc.state is IncidentState.RESOLVED and inc.fallback and inc.successor_id == successor.engine_id
        row = next(r for r in inc.timeline() if r["step"] == str(Step.FALLBACK) and r["event"] == "done")
        assert str(row["detail"]).startswith("weights from host in ")
        print(f"cold start from the host tier: {weights}, incident {inc.timings_ms()}, timeline: {row}")  # noqa: T201
    finally:
        await sc.close()
        await asyncio.to_thread(sc.stop)


async def ready_successor(sc: Scenario, first: EngineInfo) -> EngineInfo | None:
    ready = [e for e in await sc.engines()
             if e.engine_id != first.engine_id and e.state == "ready" and e.role == "active"]
    return ready[0] if ready else None
