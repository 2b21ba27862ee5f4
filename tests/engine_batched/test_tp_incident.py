"""The batched engine tensor-parallel (TP=2, gloo, the host backend with two simulated GPUs) on the real stack (nats,
etcd, gpu_manager, agent, controller, dc_manager, router), as tests/e2e/test_tp_incident.py runs the reference
engine: SIGKILL of rank 1 is one fault and one incident for the group; the dc_manager freezes the gang and a
successor group takes every rank's leases over with the weights file renamed away; the router serves the same greedy
output (deterministic mode) from one endpoint before and after."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from devstack.scenario import MODEL, Scenario
from devstack.stack import Stack, StackConfig
from libs.common.events import EngineSpec, FaultDetected
from tests.e2e.test_tp_incident import follower_pids, greedy, incidents, routed, wait_successor
from tests.engine.support import make_tiny_weights


class BatchedGroupScenario(Scenario):
    """One batched TP=2 engine, no standby (standby groups are not built)."""

    def start(self) -> Stack:
        make_tiny_weights(self.weights)
        command = [sys.executable, "-m", "engines.batched", "--weights", str(self.weights), "--size", self.size,
                   "--deterministic", "--max-num-seqs", "16", "--num-blocks", "256"]
        spec = EngineSpec(engine_class="batched", model=MODEL, command=command, replicas=1, standbys=0, tp=2,
                          cold_start_s=30.0, env={"HF_ENGINE_MEMORY": "leased"})
        self.stack = Stack(StackConfig.ephemeral(base_dir=self.work_dir / "stack", backend="host",
                                                 engines_file=self.write_specs(spec),
                                                 extra_env={"HF_GPUS": json.dumps(["0", "1"])}))
        self.stack.start(timeout=120)
        return self.stack


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_a_batched_ranks_sigkill_is_one_incident_recovered_by_a_group_takeover(tmp_path: Path) -> None:
    sc = BatchedGroupScenario(size="tiny", backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    try:
        await asyncio.to_thread(sc.start)
        await sc.connect()
        assert sc.bus is not None
        faults: list[FaultDetected] = []

        async def on_fault(env: object) -> None:
            faults.append(env.data)  # type: ignore[attr-defined]

        await sc.bus.subscribe("fault.detected", on_fault)
        group = await sc.wait_serving(standbys=0, timeout=180)
        assert group.tp == 2 and group.ranks == [group.engine_id, f"{group.engine_id}-r1"]
        assert list((await routed(sc)).values()) == [group.endpoint]
        async with httpx.AsyncClient() as client:
            before = await greedy(sc, client)
            assert group.pid is not None
            leased = (await sc.leases()).leases
            (follower,) = follower_pids(group.pid)
            sc.weights.rename(sc.weights.with_suffix(".gone"))  # the successor group has the leases only
            seen = len(sc.events)
            os.kill(follower, signal.SIGKILL)  # rank 1
            await sc.wait_event("incident.resolved", 120, after=seen)
            successor = await wait_successor(sc, group)
            after = await greedy(sc, client)
            health = await sc.engine_health(successor.endpoint or "")
        assert after == before
        assert health["memory"]["source"] == "takeover" and health["tp"]["ranks"] == 2
        assert health["tp"]["gang"]["owners"] == successor.ranks and health["tp"]["gang"]["generation"] == 2
        await asyncio.sleep(1.0)  # a second fault or incident would show by now
        assert [(f.engine_id, f.group) for f in faults] == [(group.engine_id, group.engine_id)]
        incs = await incidents(sc)
        assert len(incs) == 1 and incs[0].gang == group.engine_id and not incs[0].fallback
        assert list((await routed(sc)).values()) == [successor.endpoint]
        moved = (await sc.leases()).leases  # the first group's four leases, each moved once
        assert sorted((i.id, i.owner, i.epoch) for i in moved) == sorted(
            (i.id, i.owner.replace(group.engine_id, successor.engine_id), i.epoch + 1) for i in leased)
    finally:
        await sc.close()
        await asyncio.to_thread(sc.stop)
