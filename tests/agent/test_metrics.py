"""The agent's Prometheus /metrics (issue 24, part 4): engines by role and state, starts, detections and
takeovers move with a real agent, real engine processes and a real SIGKILL."""

from __future__ import annotations

import os
import signal

from libs.common import procs
from libs.common.bus import Bus
from libs.common.events import EngineRole, Takeover, TakeoverReply
from services.agent.settings import AgentSettings
from tests.agent.conftest import AgentProcess, Recorder, pattern_spec
from tests.gpu_manager.harness import until
from tests.scrape import scrape


def engines(m: dict, role: str, state: str) -> float:
    return m[("holdfast_agent_engines", (("role", role), ("state", state)))]


async def test_metrics_follow_a_detection_and_a_standby_takeover(agent: AgentProcess, recorder: Recorder,
                                                                bus: Bus) -> None:
    port = procs.free_port()
    agent.start([pattern_spec(standbys=1)], metrics_port=port)
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE)).engine
    await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.STANDBY)
    before = scrape(port)
    assert (engines(before, "active", "ready"), engines(before, "standby", "standby")) == (1, 1)
    assert before[("holdfast_agent_engine_starts_total", (("role", "active"),))] == 1
    assert before[("holdfast_agent_engine_starts_total", (("role", "standby"),))] == 1
    assert ("holdfast_agent_detections_total", (("kind", "killed"), ("role", "active"))) not in before

    os.kill(active.pid, signal.SIGKILL)
    await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id)
    reply = await bus.request("node-1", Takeover(incident_id="inc-m", engine_id=active.engine_id,
                                                 transfer_token="tok"), TakeoverReply, timeout=20)
    assert reply.used_standby
    after = scrape(port)
    assert after[("holdfast_agent_detections_total", (("kind", "killed"), ("role", "active")))] == 1
    assert after[("holdfast_agent_takeovers_total", (("successor", "standby"),))] == 1
    assert after[("holdfast_agent_takeover_seconds_count", (("successor", "standby"),))] == 1
    assert 0 < after[("holdfast_agent_takeover_seconds_sum", (("successor", "standby"),))] \
        == reply.timings_ms["total_ms"] / 1000.0
    assert engines(after, "active", "ready") == 1  # the standby, now serving
    # The used standby is replaced in the background: one more standby start.
    await until(lambda: scrape(port)[("holdfast_agent_engine_starts_total", (("role", "standby"),))] == 2)


def test_metrics_are_off_by_default_and_on_loopback() -> None:
    s = AgentSettings()
    assert (s.metrics_port, s.metrics_host) == (None, "127.0.0.1")
