"""Takeover with real leased memory: a real gpu_manager (host backend), engines on the SDK, checksums."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from libs.common.bus import Bus
from libs.common.events import (
    EngineRole,
    FaultKind,
    Freeze,
    FreezeReply,
    ListLeases,
    ListLeasesReply,
    Takeover,
    TakeoverReply,
)
from tests.agent.conftest import AgentProcess, Recorder, alive, pattern_spec
from tests.gpu_manager.harness import ManagerProc
from tests.support import wait_until

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


async def test_a_successor_that_died_before_owning_its_predecessors_memory_hands_it_on_to_the_next(
        gpu_manager: ManagerProc, agent: AgentProcess, recorder: Recorder, bus: Bus) -> None:
    agent.start([pattern_spec(replicas=2, standbys=1, env={"HF_PATTERN_BYTES": str(NBYTES)})])
    await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.STANDBY)

    def actives() -> list:
        return list({e.engine.engine_id: e.engine for e in recorder.of("engine.ready")
                     if e.engine.role is EngineRole.ACTIVE}.values())

    await wait_until(lambda: len(actives()) >= 2)
    first, second = actives()[:2]
    os.kill(first.pid, signal.SIGKILL)
    await recorder.wait("fault.detected", lambda f: f.engine_id == first.engine_id)
    frozen = await bus.request("node-1", Freeze(owner=first.engine_id, incident_id="inc-first"), FreezeReply,
                               timeout=10)
    # `second` stands for first's successor that died before it owned first's leases (a shadow promoted early):
    # its own incident's takeover names first's frozen memory.
    os.kill(second.pid, signal.SIGKILL)
    await recorder.wait("fault.detected", lambda f: f.engine_id == second.engine_id)
    reply = await bus.request("node-1", Takeover(incident_id="inc-second", engine_id=second.engine_id,
                                                 memory_of=first.engine_id, transfer_token=frozen.transfer_token),
                              TakeoverReply, timeout=30)

    assert reply.used_standby and reply.engine.successor_of == first.engine_id
    held = await bus.request("node-1", ListLeases(owner=reply.engine.engine_id), ListLeasesReply, timeout=10)
    assert {lease.id for lease in held.leases} == set(frozen.lease_ids)
    after = await _checksum(reply.engine.endpoint or "")
    assert after["bytes"] == NBYTES and after["pattern_ok"]
    reattached = await recorder.wait("engine.reattached", lambda e: e.incident_id == "inc-second")
    assert reattached.predecessor_id == second.engine_id
