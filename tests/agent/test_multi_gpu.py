"""A node with two GPUs (the host backend's simulated ones): real agent, gpu_manager and engine processes.

Replicas are spread over the spec's GPUs (named by UUID or index); the gpu_manager publishes each GPU's record
(capacity, leased bytes, health) to etcd and as events; a GPU marked failed faults and kills the engines on it,
loses its leases, and no engine starts on it again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.common.bus import Bus
from libs.common.events import (
    EngineRole,
    FaultKind,
    GpuRecord,
    ListLeases,
    ListLeasesReply,
    MarkGpu,
    MarkGpuReply,
)
from libs.common.gpu import simulated_uuid
from libs.common.store import Store
from tests.agent.conftest import AgentProcess, Recorder, alive, pattern_spec
from tests.gpu_manager.harness import ManagerProc
from tests.support import wait_until

NBYTES = 4 << 20
CAPACITY = 64 << 20  # two simulated GPUs of 32 MiB each
GPUS = json.dumps(["0", "1"])


@pytest.fixture
def two_gpu_manager(settings_env: dict[str, str]) -> Iterator[ManagerProc]:
    env = {**settings_env, "HF_BACKEND": "host", "HF_CHUNK_MIB": "2", "HF_RECONCILE_INTERVAL_S": "0.1",
           "HF_GPUS": GPUS, "HF_HOST_CAPACITY_BYTES": str(CAPACITY), "HF_GPU_PUBLISH_INTERVAL_S": "0.1"}
    mgr = ManagerProc(env, Path(settings_env["HF_STATE_DIR"])).start()
    yield mgr
    mgr.stop()


async def _record(store: Store, gpu: int) -> GpuRecord | None:
    raw = await store.get(f"gpus/node-1/{gpu}")
    return GpuRecord.model_validate_json(raw) if raw else None


async def test_replicas_spread_over_two_gpus_and_a_failed_gpu_loses_its_engines_leases_and_new_engines(
        two_gpu_manager: ManagerProc, agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store) -> None:
    await bus.subscribe("node.gpu.>", recorder.handler)
    uuid1 = simulated_uuid("node-1", 1)
    spec = pattern_spec(replicas=2, env={"HF_PATTERN_BYTES": str(NBYTES)})
    spec = spec.model_copy(update={"gpus": [uuid1, 0]})  # one by UUID, one by index
    agent.start([spec], gpus=GPUS, takeover_wait_s=0.5)

    def actives() -> dict[str, object]:
        return {e.engine.engine_id: e.engine for e in recorder.of("engine.ready")
                if e.engine.role is EngineRole.ACTIVE}

    await wait_until(lambda: len(actives()) >= 2)
    by_gpu = {e.gpu: e for e in actives().values()}  # type: ignore[attr-defined]
    assert set(by_gpu) == {0, 1}
    assert by_gpu[1].gpu_uuid == uuid1 and by_gpu[0].gpu_uuid == simulated_uuid("node-1", 0)

    # Each GPU's record: its share of the capacity, the bytes its engine leased, healthy.
    for gpu in (0, 1):
        rec = await wait_until(lambda g=gpu: _leased(store, g, NBYTES))
        assert rec.total_bytes == CAPACITY // 2 and rec.healthy and rec.uuid == simulated_uuid("node-1", gpu)
    started = [e.data for e in await bus.replay("node.gpu.health")]  # sent as the manager started (durable)
    assert {(h.gpu, h.healthy, h.uuid) for h in started} >= {(0, True, simulated_uuid("node-1", 0)), (1, True, uuid1)}

    doomed, spared = by_gpu[1], by_gpu[0]
    reply = await bus.request("node-1", MarkGpu(gpu=uuid1, detail="XID 79"), MarkGpuReply, timeout=10)
    assert reply.gpu == 1 and reply.engines == [doomed.engine_id]
    assert reply.gpu_manager is not None and reply.gpu_manager.lost_leases and not reply.gpu_manager.gpu.healthy

    fault = await recorder.wait("fault.detected", lambda f: f.engine_id == doomed.engine_id)
    assert fault.kind is FaultKind.GPU_FAULT and fault.gpu == 1 and fault.gpu_uuid == uuid1
    await wait_until(lambda: not alive(doomed.pid))
    lost = await recorder.wait("node.gpu.health", lambda h: h.gpu == 1 and not h.healthy)
    assert set(lost.lost_leases) == set(reply.gpu_manager.lost_leases) and lost.detail == "XID 79"
    held = await bus.request("node-1", ListLeases(owner=doomed.engine_id), ListLeasesReply, timeout=10)
    assert held.leases == []
    rec1 = await _record(store, 1)
    assert rec1 is not None and not rec1.healthy and rec1.leased_bytes == 0 and rec1.detail == "XID 79"

    # The failed replica is replaced (after takeover_wait_s) on the healthy GPU, never on the failed one.
    def replacement() -> object:
        return next((e for i, e in actives().items() if i not in (doomed.engine_id, spared.engine_id)), None)

    new = await wait_until(replacement)
    assert new.gpu == 0  # type: ignore[attr-defined]
    assert alive(spared.pid)
    assert not recorder.of("fault.detected", lambda f: f.engine_id == spared.engine_id)
    await wait_until(lambda: _leased(store, 0, 2 * NBYTES))


async def _leased(store: Store, gpu: int, nbytes: int) -> GpuRecord | None:
    rec = await _record(store, gpu)
    return rec if rec is not None and rec.leased_bytes == nbytes else None
