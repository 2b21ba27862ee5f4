"""Standby mode under a real agent and gpu_manager: the standby warms up, reports standby, takes over the
killed engine's leases when the agent assigns it, and serves identical greedy output."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import (
    EngineInfo,
    EngineRole,
    EngineSpec,
    Freeze,
    FreezeReply,
    ListEngines,
    ListEnginesReply,
    ListLeases,
    ListLeasesReply,
    Takeover,
    TakeoverReply,
)
from tests.agent.conftest import AgentProcess, Recorder
from tests.engine.support import generate
from tests.gpu_manager.harness import until

PROMPT = {"prompt": "A standby is ready.", "max_tokens": 40, "ignore_eos": True}


def reference_spec(weights: Path, *, shadow: bool = True) -> EngineSpec:
    return EngineSpec(engine_class="reference", model="tiny-ref", replicas=1, standbys=1, cold_start_s=10.0,
                      command=[sys.executable, "-m", "engines.reference", "serve", "--size", "tiny",
                               "--weights", str(weights), "--memory", "leased"],
                      env={"HF_ENGINE_SHADOW": "true" if shadow else "false"})


async def _engines(bus: Bus, node: str) -> list[EngineInfo]:
    return (await bus.request(node, ListEngines(), ListEnginesReply, timeout=10)).engines



async def test_a_warm_standby_takes_over_the_killed_engine_and_serves_the_same_greedy_output(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],
        settings: CommonSettings, bus: Bus, agent: AgentProcess, recorder: Recorder) -> None:
    agent.start([reference_spec(tiny_weights, shadow=False)], heartbeat_timeout_s=3.0)
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE, within_s=60)).engine
    standby = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.STANDBY, within_s=60)).engine
    assert active.endpoint and standby.endpoint is None
    before = generate(active.endpoint, **PROMPT)

    os.kill(active.pid, signal.SIGKILL)
    frozen = await bus.request(settings.node, Freeze(owner=active.engine_id, incident_id="inc-sb"), FreezeReply)
    reply = await bus.request(settings.node, Takeover(incident_id="inc-sb", engine_id=active.engine_id,
                                                       transfer_token=frozen.transfer_token), TakeoverReply, timeout=30)
    assert reply.used_standby and reply.engine.engine_id == standby.engine_id
    assert reply.engine.endpoint
    health = httpx.get(reply.engine.endpoint + "/health", timeout=10).json()
    assert health["state"] == "ready" and health["memory"]["source"] == "takeover"
    assert health["recovery"]["first_token_ms"] > 0 and health["warmup_ms"] > 0
    assert health["assignment"]["predecessor"] == active.engine_id
    assert generate(reply.engine.endpoint, **PROMPT)["tokens"] == before["tokens"]


async def test_a_shadowing_standby_serves_at_once_and_owns_the_leases_once_the_predecessor_is_dead(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],
        settings: CommonSettings, bus: Bus, agent: AgentProcess, recorder: Recorder) -> None:
    agent.start([reference_spec(tiny_weights)], heartbeat_timeout_s=3.0)
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE, within_s=60)).engine
    assert active.endpoint
    before = generate(active.endpoint, **PROMPT)

    async def shadow() -> EngineInfo | None:
        return next((e for e in await _engines(bus, settings.node) if e.shadows == active.engine_id), None)

    standby = await until(shadow)
    assert standby.role is EngineRole.STANDBY and standby.state == "standby"
    leases_before = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
    weights = {i.id for i in leases_before if i.owner == active.engine_id and i.tag == "weights"}
    pred_kv = {i.id for i in leases_before if i.owner == active.engine_id and i.tag == "kv_cache"}
    own_kv = {i.id for i in leases_before if i.owner == standby.engine_id}
    assert weights and pred_kv and len(own_kv) == 1  # the shadow leased a KV cache of its own

    os.kill(active.pid, signal.SIGKILL)
    frozen = await bus.request(settings.node, Freeze(owner=active.engine_id, incident_id="inc-sh"), FreezeReply)
    reply = await bus.request(settings.node, Takeover(incident_id="inc-sh", engine_id=active.engine_id,
                                                       transfer_token=frozen.transfer_token), TakeoverReply, timeout=30)
    assert reply.used_standby and reply.engine.engine_id == standby.engine_id
    assert reply.timings_ms["shadowed"] == 1.0
    assert reply.engine.endpoint
    assert generate(reply.engine.endpoint, **PROMPT)["tokens"] == before["tokens"]

    async def adopted() -> dict | None:
        health = httpx.get(reply.engine.endpoint + "/health", timeout=10).json()
        return health if "adopted" in health.get("recovery", {}) else None

    health = await until(adopted)
    assert health["recovery"]["source"] == "shadow" and health["shadow"]["read_only"] is True
    after = {i.id: i for i in (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases}
    assert {i for i in weights if after[i].owner == standby.engine_id and after[i].epoch == 2} == weights
    assert not pred_kv & set(after)  # the predecessor's KV cache, unused by the successor, was given back
    assert own_kv <= set(after) and after[own_kv.pop()].owner == standby.engine_id


async def test_an_injected_cuda_error_is_reported_as_one_cuda_error_fault(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],
        settings: CommonSettings, bus: Bus, agent: AgentProcess, recorder: Recorder) -> None:
    spec = reference_spec(tiny_weights).model_copy(update={"standbys": 0})
    agent.start([spec], heartbeat_timeout_s=3.0)
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE, within_s=60)).engine
    os.kill(active.pid, signal.SIGUSR1)  # the chaos run's "engine reported a CUDA error"
    fault = await recorder.wait("fault.detected", lambda e: e.engine_id == active.engine_id, within_s=20)
    assert fault.kind == "cuda_error" and "illegal memory access" in fault.detail
