"""Standby mode under a real agent and gpu_manager: the standby warms up, reports standby, takes over the
killed engine's leases when the agent assigns it, and serves identical greedy output."""

from __future__ import annotations

import itertools
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
    StopEngine,
    StopReply,
    Takeover,
    TakeoverReply,
)
from tests.agent.conftest import AgentProcess, Recorder
from tests.engine.support import generate, in_flight
from tests.gpu_manager.harness import until

PROMPT = {"prompt": "A standby is ready.", "max_tokens": 40, "ignore_eos": True}
PROMPT_TOKENS = 1 + len("A standby is ready.")  # BOS + bytes
KV_REUSE_S = 2.0  # how long a promoted shadow reads its predecessor's cache


def reference_spec(weights: Path, *, shadow: bool = True) -> EngineSpec:
    return EngineSpec(engine_class="reference", model="tiny-ref", replicas=1, standbys=1, cold_start_s=30.0,
                      command=[sys.executable, "-m", "engines.reference", "serve", "--size", "tiny",
                               "--weights", str(weights), "--memory", "leased"],
                      env={"HF_ENGINE_SHADOW": "true" if shadow else "false", "HF_ENGINE_KV_REUSE_S": str(KV_REUSE_S)})


async def _engines(bus: Bus, node: str) -> list[EngineInfo]:
    return (await bus.request(node, ListEngines(), ListEnginesReply, timeout=10)).engines


async def _kill_and_take_over(bus: Bus, node: str, engine: EngineInfo, incident_id: str) -> TakeoverReply:
    """SIGKILL the engine, then what the dc_manager would send: freeze its leases, take it over."""
    assert engine.pid is not None
    os.kill(engine.pid, signal.SIGKILL)
    frozen = await bus.request(node, Freeze(owner=engine.engine_id, incident_id=incident_id), FreezeReply)
    return await bus.request(node, Takeover(incident_id=incident_id, engine_id=engine.engine_id,
                                            transfer_token=frozen.transfer_token), TakeoverReply, timeout=30)



async def _an_engine_and_its_shadow(weights: Path, settings: CommonSettings, bus: Bus, agent: AgentProcess,
                                    recorder: Recorder) -> tuple[EngineInfo, EngineInfo, dict]:
    """An active engine serving (with its answer to PROMPT) and the standby shadowing it."""
    agent.start([reference_spec(weights)], heartbeat_timeout_s=3.0)
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE, within_s=60)).engine
    assert active.endpoint
    before = generate(active.endpoint, **PROMPT)

    async def shadow() -> EngineInfo | None:
        return next((e for e in await _engines(bus, settings.node) if e.shadows == active.engine_id), None)

    return active, await until(shadow), before


async def test_a_warm_standby_takes_over_the_killed_engine_and_serves_the_same_greedy_output(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],
        settings: CommonSettings, bus: Bus, agent: AgentProcess, recorder: Recorder) -> None:
    agent.start([reference_spec(tiny_weights, shadow=False)], heartbeat_timeout_s=3.0)
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE, within_s=60)).engine
    standby = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.STANDBY, within_s=60)).engine
    assert active.endpoint and standby.endpoint is None
    before = generate(active.endpoint, **PROMPT)

    reply = await _kill_and_take_over(bus, settings.node, active, "inc-sb")
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
    active, standby, before = await _an_engine_and_its_shadow(tiny_weights, settings, bus, agent, recorder)
    assert standby.role is EngineRole.STANDBY and standby.state == "standby"
    leases_before = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
    weights = {i.id for i in leases_before if i.owner == active.engine_id and i.tag == "weights"}
    pred_kv = {i.id for i in leases_before if i.owner == active.engine_id and i.tag == "kv_cache"}
    own_kv = {i.id for i in leases_before if i.owner == standby.engine_id}
    assert weights and pred_kv and len(own_kv) == 1  # the shadow leased a KV cache of its own

    reply = await _kill_and_take_over(bus, settings.node, active, "inc-sh")
    assert reply.used_standby and reply.engine.engine_id == standby.engine_id
    assert reply.timings_ms["shadowed"] == 1.0
    assert reply.engine.endpoint
    assert generate(reply.engine.endpoint, **PROMPT)["tokens"] == before["tokens"]

    async def adopted() -> dict | None:
        health = httpx.get(reply.engine.endpoint + "/health", timeout=10).json()
        return health if "adopted" in health.get("recovery", {}) else None

    health = await until(adopted)
    assert health["recovery"]["source"] == "shadow" and health["shadow"]["read_only"] is True

    async def given_back() -> dict | None:  # the predecessor's KV cache, once its prefixes were no longer read
        leases = {i.id: i for i in (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases}
        return None if pred_kv & set(leases) else leases

    after = await until(given_back, timeout=KV_REUSE_S + 20)
    assert {i for i in weights if after[i].owner == standby.engine_id and after[i].epoch == 2} == weights
    assert own_kv <= set(after) and after[own_kv.pop()].owner == standby.engine_id


async def test_a_request_resumed_on_the_promoted_shadow_reuses_the_killed_engines_cache_and_continues_exactly(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],
        settings: CommonSettings, bus: Bus, agent: AgentProcess, recorder: Recorder) -> None:
    active, _, before = await _an_engine_and_its_shadow(tiny_weights, settings, bus, agent, recorder)
    assert active.endpoint
    whole = before["tokens"]
    with in_flight(active.endpoint, 5, **PROMPT) as first:
        reply = await _kill_and_take_over(bus, settings.node, active, "inc-kv")
    assert first == whole[:5] and reply.engine.endpoint and reply.timings_ms["shadowed"] == 1.0

    resumed = generate(reply.engine.endpoint, **{**PROMPT, "max_tokens": 35}, resume=first)  # as a router does
    assert resumed["tokens"] == whole[5:]
    health = httpx.get(reply.engine.endpoint + "/health", timeout=10).json()
    reused = health["kv_reused"]
    assert reused["positions"] >= PROMPT_TOKENS + 4 and reused["refused"] == 0
    # The generation in flight at the kill was continued at the promotion: the request took that forward,
    # unless (the tiny model is fast) the predecessor had already finished it, leaving nothing in flight.
    assert reused["continued_taken"] <= reused["continued"] <= 1
    # A fresh prompt is computed as ever, and gives what it gave before the failover.
    assert generate(reply.engine.endpoint, **PROMPT)["tokens"] == whole


async def test_a_standby_shadowing_another_engine_drops_its_shadow_and_takes_over_the_failed_one(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],
        settings: CommonSettings, bus: Bus, agent: AgentProcess, recorder: Recorder) -> None:
    spec = reference_spec(tiny_weights).model_copy(update={"replicas": 2})
    agent.start([spec], heartbeat_timeout_s=3.0)
    await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE, within_s=60)

    async def shadowing() -> tuple[EngineInfo, list[EngineInfo]] | None:
        engines = await _engines(bus, settings.node)
        actives = [e for e in engines if e.role is EngineRole.ACTIVE and e.state == "ready"]
        sb = next((e for e in engines if e.role is EngineRole.STANDBY and e.shadows), None)
        return (sb, actives) if sb is not None and len(actives) == 2 else None

    standby, actives = await until(shadowing)
    other = next(a for a in actives if a.engine_id != standby.shadows)  # the engine nobody shadows
    assert other.endpoint
    before = generate(other.endpoint, **PROMPT)

    reply = await _kill_and_take_over(bus, settings.node, other, "inc-other")
    assert reply.used_standby and reply.engine.engine_id == standby.engine_id
    assert reply.timings_ms["shadowed"] == 0.0  # the old path: the kill confirmed, then the leases attached
    assert reply.engine.endpoint
    health = httpx.get(reply.engine.endpoint + "/health", timeout=10).json()
    assert health["memory"]["source"] == "takeover" and "shadow" not in health
    assert generate(reply.engine.endpoint, **PROMPT)["tokens"] == before["tokens"]
    # The dropped shadow's read-only mapping of the still-serving engine's weights is gone from the process.
    shadowed = {i.id for i in (await bus.request(settings.node, ListLeases(owner=standby.shadows),
                                                 ListLeasesReply)).leases if i.tag == "weights"}
    with open(f"/proc/{reply.engine.pid}/maps") as f:
        maps = f.read()
    assert shadowed and not any(f"hf-{lease}-" in maps for lease in shadowed)


async def test_a_shadow_is_dropped_when_the_engine_it_shadows_is_stopped(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],
        settings: CommonSettings, bus: Bus, agent: AgentProcess, recorder: Recorder) -> None:
    agent.start([reference_spec(tiny_weights)], heartbeat_timeout_s=3.0)
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE, within_s=60)).engine

    async def standby_of(owner: str | None) -> EngineInfo | None:
        return next((e for e in await _engines(bus, settings.node)
                     if e.role is EngineRole.STANDBY and e.shadows == owner), None)

    standby = await until(lambda: standby_of(active.engine_id))
    weights = {i.id for i in (await bus.request(settings.node, ListLeases(owner=active.engine_id),
                                                ListLeasesReply)).leases if i.tag == "weights"}

    def maps_of(pid: int | None) -> str:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()

    assert weights and all(f"hf-{lease}-" in maps_of(standby.pid) for lease in weights)
    await bus.request(settings.node, StopEngine(engine_id=active.engine_id), StopReply, timeout=30)
    dropped = await until(lambda: standby_of(None))
    assert dropped.engine_id == standby.engine_id
    # its mapping would keep the stopped engine's memory alive after the reclaim (the agent reports the drop
    # when it orders it; the standby unmaps once the model over the memory is collected)
    async def unmapped() -> bool:
        return not any(f"hf-{lease}-" in maps_of(standby.pid) for lease in weights)

    assert await until(unmapped)


async def test_an_injected_cuda_error_is_reported_as_one_cuda_error_fault(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],
        settings: CommonSettings, bus: Bus, agent: AgentProcess, recorder: Recorder) -> None:
    spec = reference_spec(tiny_weights).model_copy(update={"standbys": 0})
    agent.start([spec], heartbeat_timeout_s=3.0)
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE, within_s=60)).engine
    os.kill(active.pid, signal.SIGUSR1)  # the chaos run's "engine reported a CUDA error"
    fault = await recorder.wait("fault.detected", lambda e: e.engine_id == active.engine_id, within_s=20)
    assert fault.kind == "cuda_error" and "illegal memory access" in fault.detail


async def test_a_shadow_told_its_engine_failed_resumes_the_generation_in_flight_before_it_is_assigned(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],
        settings: CommonSettings, bus: Bus, agent: AgentProcess, recorder: Recorder) -> None:
    active, standby, _ = await _an_engine_and_its_shadow(tiny_weights, settings, bus, agent, recorder)
    assert active.endpoint and active.pid is not None
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", active.endpoint + "/generate", json={**PROMPT, "max_tokens": 1500, "stream": True}) as r:
        assert len(list(itertools.islice(r.iter_lines(), 5))) == 5  # a long generation, in flight at the kill
        os.kill(active.pid, signal.SIGKILL)
    await recorder.wait("fault.detected", lambda e: e.engine_id == active.engine_id, within_s=20)
    # Only now the control plane's part (the agent has told the shadow already): freeze, take over.
    frozen = await bus.request(settings.node, Freeze(owner=active.engine_id, incident_id="inc-early"), FreezeReply)
    reply = await bus.request(settings.node, Takeover(incident_id="inc-early", engine_id=active.engine_id,
                                                      transfer_token=frozen.transfer_token), TakeoverReply, timeout=30)
    assert reply.used_standby and reply.engine.engine_id == standby.engine_id and reply.engine.endpoint

    async def continued() -> dict | None:
        health = httpx.get(reply.engine.endpoint + "/health", timeout=10).json()
        return health.get("continued")

    got = await until(continued)
    assert got["generations"] == 1 and got["early"] is True
    assert generate(reply.engine.endpoint, **PROMPT)["tokens"][:5]  # and it serves
