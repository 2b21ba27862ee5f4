"""Takeover without memory: standby hand-over, fencing of a live predecessor, cold spawn, idempotency, errors."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from libs.common.bus import Bus
from libs.common.errors import RemoteError
from libs.common.events import EngineRole, FaultKind, Takeover, TakeoverReply
from libs.common.store import Store
from tests.agent.conftest import AgentProcess, Recorder, alive, engine_records, pattern_spec
from tests.support import wait_until


async def _ready_pair(agent: AgentProcess, recorder: Recorder, **env: str) -> tuple:
    agent.start([pattern_spec(standbys=1, env=env)])
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE)).engine
    standby = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.STANDBY)).engine
    return active, standby


async def test_a_hung_engine_is_killed_and_its_standby_takes_over(agent: AgentProcess, recorder: Recorder,
                                                                   bus: Bus) -> None:
    active, standby = await _ready_pair(agent, recorder)
    os.kill(active.pid, signal.SIGSTOP)
    fault = await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id)
    assert fault.kind is FaultKind.HUNG
    reply = await bus.request("node-1", Takeover(incident_id="inc-1", engine_id=active.engine_id, transfer_token="tok"),
                              TakeoverReply, timeout=20)
    assert reply.used_standby and reply.engine.engine_id == standby.engine_id
    assert reply.engine.role is EngineRole.ACTIVE and reply.engine.state == "ready"
    assert reply.engine.generation == active.generation + 1
    assert not alive(active.pid)  # fenced: dead before the standby got the memory
    assert {"kill_ms", "assign_ms", "attach_ready_ms", "ready_to_reply_ms", "total_ms"} <= set(reply.timings_ms)
    reattached = await recorder.wait("engine.reattached", lambda e: e.incident_id == "inc-1")
    assert reattached.predecessor_id == active.engine_id and reattached.used_standby
    # The reply goes first after the successor's "ready", yet its engine.ready still precedes engine.reattached.
    order = [e.type for e in recorder.events if e.type in ("engine.ready", "engine.reattached")
             and (e.type == "engine.reattached" or e.data.engine.engine_id == standby.engine_id)]
    assert order == ["engine.ready", "engine.ready", "engine.reattached"]  # warm, then serving, then taken over
    # A new standby replaces the one that was used, in the background.
    await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.STANDBY
                        and e.engine.engine_id != standby.engine_id)
    # The hung engine's later death was the same fault: still exactly one event for it.
    stored = [e for e in await bus.replay("fault.detected") if e.data.engine_id == active.engine_id]
    assert len(stored) == 1


async def test_a_duplicate_takeover_returns_the_first_result(agent: AgentProcess, recorder: Recorder, bus: Bus) -> None:
    active, standby = await _ready_pair(agent, recorder)
    cmd = Takeover(incident_id="inc-dup", engine_id=active.engine_id, transfer_token="tok")
    first = await bus.request("node-1", cmd, TakeoverReply, timeout=20)
    again = await bus.request("node-1", cmd, TakeoverReply, timeout=20)
    assert again == first
    assert len(recorder.of("engine.reattached", lambda e: e.incident_id == "inc-dup")) == 1


async def test_a_takeover_of_an_unknown_engine_is_a_typed_not_found(agent: AgentProcess, bus: Bus, store: Store) -> None:
    agent.start([])
    await agent.wait_up(store)
    with pytest.raises(RemoteError) as err:
        await bus.request("node-1", Takeover(incident_id="inc-x", engine_id="no-such", transfer_token="t"),
                          TakeoverReply, timeout=20)
    assert err.value.remote_code == "not_found"


async def test_without_a_standby_a_new_process_is_cold_spawned(agent: AgentProcess, recorder: Recorder,
                                                               bus: Bus, store: Store) -> None:
    agent.start([pattern_spec(standbys=0)])
    active = (await recorder.wait("engine.ready")).engine
    os.kill(active.pid, signal.SIGKILL)
    await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id)
    reply = await bus.request("node-1", Takeover(incident_id="inc-cold", engine_id=active.engine_id,
                                                 transfer_token="tok"), TakeoverReply, timeout=30)
    assert not reply.used_standby and reply.engine.engine_id != active.engine_id
    assert reply.engine.state == "ready" and "spawn_ms" in reply.timings_ms
    environ = open(f"/proc/{reply.engine.pid}/environ", "rb").read().split(b"\0")
    assert f"HF_TAKEOVER_FROM={active.engine_id}".encode() in environ and b"HF_TRANSFER_TOKEN=tok" in environ
    assert reply.engine.successor_of == active.engine_id
    # its etcd record says whose memory it holds too (the dc_manager's freeze hands it on if it dies unowned)
    await wait_until(lambda: _successor_recorded(store, reply.engine.engine_id, active.engine_id))


async def test_a_standby_that_dies_during_takeover_falls_back_to_a_cold_spawn(agent: AgentProcess, recorder: Recorder,
                                                                              bus: Bus) -> None:
    active, standby = await _ready_pair(agent, recorder, HF_PATTERN_CRASH_ON_ASSIGN="1")
    reply = await bus.request("node-1", Takeover(incident_id="inc-fb", engine_id=active.engine_id,
                                                 transfer_token="tok"), TakeoverReply, timeout=30)
    assert not reply.used_standby
    assert reply.engine.engine_id not in (active.engine_id, standby.engine_id)
    assert "standby_failed_ms" in reply.timings_ms
    assert not alive(standby.pid)


async def test_a_takeover_waits_for_a_standby_still_warming_rather_than_spawning_another(
        agent: AgentProcess, recorder: Recorder, bus: Bus) -> None:
    """No standby warm yet (a refill after an earlier takeover, say), one starting: the takeover waits for it and
    assigns it; no second process is spawned beside it."""
    agent.start([pattern_spec(standbys=1, env={"HF_PATTERN_WARM_S": "5"})])  # a CUDA context and kernels, say
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE)).engine
    warming = (await recorder.wait("engine.started", lambda e: e.engine.role is EngineRole.STANDBY)).engine
    os.kill(active.pid, signal.SIGKILL)
    await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id)
    reply = await bus.request("node-1", Takeover(incident_id="inc-warm", engine_id=active.engine_id,
                                                 transfer_token="tok"), TakeoverReply, timeout=60)
    assert reply.used_standby and reply.engine.engine_id == warming.engine_id
    assert reply.engine.role is EngineRole.ACTIVE and reply.engine.state == "ready"
    assert "standby_warm_wait_ms" in reply.timings_ms  # it was still starting when the takeover came
    assert "spawn_ms" not in reply.timings_ms
    spawned = recorder.of("engine.started", lambda e: e.engine.role is EngineRole.ACTIVE)
    assert [e.engine.engine_id for e in spawned] == [active.engine_id]  # nothing cold-spawned for the takeover


async def test_a_standby_that_dies_while_warming_is_replaced_by_a_cold_spawn(agent: AgentProcess,
                                                                            recorder: Recorder, bus: Bus) -> None:
    agent.start([pattern_spec(standbys=1, env={"HF_PATTERN_WARM_S": "30"})])
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE)).engine
    warming = (await recorder.wait("engine.started", lambda e: e.engine.role is EngineRole.STANDBY)).engine
    os.kill(active.pid, signal.SIGKILL)
    await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id)
    takeover = asyncio.create_task(bus.request("node-1", Takeover(incident_id="inc-warm-dies", engine_id=active.engine_id,
                                                                  transfer_token="tok"), TakeoverReply, timeout=60))
    await asyncio.sleep(1.0)  # the takeover waits on it
    assert not takeover.done()
    os.kill(warming.pid, signal.SIGKILL)
    reply = await takeover
    assert not reply.used_standby and reply.engine.engine_id not in (active.engine_id, warming.engine_id)
    assert "standby_warm_wait_ms" in reply.timings_ms and "spawn_ms" in reply.timings_ms


async def _successor_recorded(store: Store, engine_id: str, predecessor: str) -> bool:
    rec = (await engine_records(store)).get(engine_id)
    return rec is not None and rec.successor_of == predecessor
