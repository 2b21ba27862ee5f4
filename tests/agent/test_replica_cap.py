"""Never more running actives than a spec's `replicas`, whatever order a takeover's cold successor and the control
plane's fallback cold start come in (issue 18, part 1: a SIGKILL during start-up multiplied the model)."""

from __future__ import annotations

import os
import signal

import pytest

from libs.common.bus import Bus
from libs.common.errors import RemoteError
from libs.common.events import (
    EngineRole,
    ListEngines,
    ListEnginesReply,
    Spawn,
    SpawnReply,
    Takeover,
    TakeoverReply,
)
from services.agent.engines import EngineRecord, State
from services.agent.supervision import admit_active, spec_key
from tests.agent.conftest import AgentProcess, Recorder, pattern_spec

SPEC = pattern_spec(standbys=0)
KEY = spec_key(SPEC)


async def running_actives(bus: Bus) -> list[str]:
    listed = await bus.request("node-1", ListEngines(), ListEnginesReply, timeout=10)
    return sorted(e.engine_id for e in listed.engines if e.role is EngineRole.ACTIVE and e.state in ("starting", "ready"))


async def _failed_active(agent: AgentProcess, recorder: Recorder) -> str:
    agent.start([SPEC])
    active = (await recorder.wait("engine.ready")).engine
    os.kill(active.pid, signal.SIGKILL)
    await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id)
    return active.engine_id


async def test_a_fallback_cold_start_after_the_takeovers_successor_is_refused(agent: AgentProcess, recorder: Recorder,
                                                                              bus: Bus) -> None:
    dead = await _failed_active(agent, recorder)
    reply = await bus.request("node-1", Takeover(incident_id="inc-a", engine_id=dead, transfer_token="tok"),
                              TakeoverReply, timeout=30)
    assert reply.engine.state == "ready"
    # the control plane's fallback for the same slot (a missed deadline, another incident) comes late
    with pytest.raises(RemoteError) as refused:
        await bus.request("node-1", Spawn(spec=SPEC, engine_id="cs-inc-a", incident_id="inc-a"), SpawnReply,
                          timeout=20)
    assert refused.value.remote_code == "conflict" and "wants 1 active" in refused.value.message
    assert await running_actives(bus) == [reply.engine.engine_id]
    assert "refused an active engine" in (agent.log_dir / "agent.log").read_text()


async def test_a_takeover_after_a_fallback_cold_start_took_the_slot_is_refused_and_fences_nobody(
        agent: AgentProcess, recorder: Recorder, bus: Bus) -> None:
    dead = await _failed_active(agent, recorder)
    cold = await bus.request("node-1", Spawn(spec=SPEC, engine_id="cs-inc-b", incident_id="inc-b"), SpawnReply,
                             timeout=20)
    await recorder.wait("engine.ready", lambda e: e.engine.engine_id == "cs-inc-b")
    with pytest.raises(RemoteError) as refused:
        await bus.request("node-1", Takeover(incident_id="inc-b2", engine_id=dead, transfer_token="tok"),
                          TakeoverReply, timeout=30)
    assert refused.value.remote_code == "conflict"
    assert await running_actives(bus) == [cold.engine.engine_id]
    assert not recorder.of("engine.started", lambda e: e.engine.engine_id not in (dead, "cs-inc-b")
                           and e.engine.role is EngineRole.ACTIVE)


def _rec(engine_id: str, state: State, *, role: EngineRole = EngineRole.ACTIVE, key: str = KEY) -> EngineRecord:
    return EngineRecord(engine_id=engine_id, model="m", engine_class="pattern", role=role, spec_key=key, state=state)


def test_the_count_is_of_running_actives_and_a_successor_fills_its_predecessors_slot():
    specs = {KEY: SPEC}
    dead = _rec("dead", State.FAILED)
    assert admit_active(specs, [dead], KEY) is None  # a failed engine runs no more
    assert admit_active(specs, [dead], KEY, replacing=dead) is None
    cold = _rec("cold", State.STARTING)
    assert "wants 1 active" in (admit_active(specs, [dead, cold], KEY, replacing=dead) or "")
    assert admit_active(specs, [dead, cold], KEY) is not None
    # a standby being promoted counts once it is assigned (it holds the slot), not while it waits
    sb = _rec("sb", State.STANDBY, role=EngineRole.STANDBY)
    assert admit_active(specs, [dead, sb], KEY, replacing=dead, candidate="sb") is None
    assigned = _rec("sb", State.ASSIGNED)
    assert admit_active(specs, [dead, assigned], KEY, replacing=_rec("other", State.FAILED)) is not None
    # a live predecessor (a manual failover) is replaced, not added to
    live = _rec("live", State.READY)
    assert admit_active(specs, [live], KEY, replacing=live) is None
    # a hot upgrade's successor of another spec is counted against its predecessor's spec
    assert admit_active(specs, [live], "other-version-key", replacing=live) is None
    assert admit_active(specs, [live, cold], "other-version-key", replacing=live) is not None
    # an engine nobody configured (adopted) has no count
    assert admit_active(specs, [live], "unknown-key") is None
