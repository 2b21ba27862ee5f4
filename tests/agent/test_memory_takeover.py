"""Takeover with real leased memory: a real gpu_manager (host backend), engines on the SDK, checksums."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from libs.common.bus import Bus
from libs.common.events import EngineRole, FaultKind, Freeze, FreezeReply, Takeover, TakeoverReply
from tests.agent.conftest import AgentProcess, Recorder, alive, pattern_spec
from tests.gpu_manager.harness import ManagerProc

NBYTES = 8 << 20


async def _checksum(endpoint: str) -> dict:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{endpoint}/checksum", timeout=10)).json()


@pytest.mark.parametrize("standbys", [1, 0], ids=["warm_standby", "cold_spawn"])
async def test_the_successor_serves_the_hung_predecessors_unchanged_memory(
        standbys: int, gpu_manager: ManagerProc, agent: AgentProcess, recorder: Recorder, bus: Bus) -> None:
    agent.start([pattern_spec(standbys=standbys, env={"HF_PATTERN_BYTES": str(NBYTES)})])
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE)).engine
    if standbys:
        await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.STANDBY)
    before = await _checksum(active.endpoint)
    assert before["bytes"] == NBYTES and before["pattern_ok"]

    os.kill(active.pid, signal.SIGSTOP)  # hung with its memory still mapped read-write
    assert (await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id)).kind is FaultKind.HUNG
    frozen = await bus.request("node-1", Freeze(owner=active.engine_id, incident_id="inc-mem"), FreezeReply, timeout=10)
    reply = await bus.request("node-1", Takeover(incident_id="inc-mem", engine_id=active.engine_id,
                                                 transfer_token=frozen.transfer_token), TakeoverReply, timeout=30)

    assert reply.used_standby is bool(standbys)
    assert not alive(active.pid)
    after = await _checksum(reply.engine.endpoint)
    assert after["engine_id"] == reply.engine.engine_id != active.engine_id
    assert after["sha256"] == before["sha256"] and after["pattern_ok"]
