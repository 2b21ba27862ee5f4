"""A fallback's spawn that names a spare (`Spawn.spare`) which is none now (gone, never one, an ordinary standby)
starts a cold engine as a spawn without one does: the spare is a shortcut, never the only way (real agent, real
engine processes)."""

from __future__ import annotations

import os
import signal

from libs.common.bus import Bus
from libs.common.events import EngineRole, ListEngines, ListEnginesReply, Spawn, SpawnReply
from tests.agent.conftest import AgentProcess, Recorder, pattern_spec

SPEC = pattern_spec(standbys=1)


async def test_a_spawn_naming_no_warm_spare_starts_a_cold_engine(agent: AgentProcess, recorder: Recorder,
                                                                  bus: Bus) -> None:
    agent.start([SPEC])
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE)).engine
    standby = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.STANDBY)).engine
    os.kill(active.pid, signal.SIGKILL)
    await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id)
    # an ordinary standby named as the spare (it maps its engine's memory on its engine's GPU: no spare) ...
    reply = await bus.request("node-1", Spawn(spec=SPEC, engine_id="cs-inc-a", incident_id="inc-a",
                                              spare=standby.engine_id), SpawnReply, timeout=30)
    assert reply.engine.engine_id == "cs-inc-a" and reply.engine.role is EngineRole.ACTIVE  # ... a cold engine
    again = await bus.request("node-1", Spawn(spec=SPEC, engine_id="cs-inc-a", incident_id="inc-a",
                                              spare=standby.engine_id), SpawnReply, timeout=30)
    assert again.engine.engine_id == "cs-inc-a"  # a repeated spawn: the same engine, no second one
    listed = (await bus.request("node-1", ListEngines(), ListEnginesReply, timeout=10)).engines
    mine = {e.engine_id: e for e in listed}
    assert mine[standby.engine_id].role is EngineRole.STANDBY and mine[standby.engine_id].state == "standby"
    assert "is no warm spare" in (agent.log_dir / "agent.log").read_text()
