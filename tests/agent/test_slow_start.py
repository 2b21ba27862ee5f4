"""What is a hang and what is not: a start-up that misses heartbeats on a loaded machine is not; an engine declared
hung because it connected too late is replaced, never taken back (one engine more than the spec wants); an engine
whose HTTP server is stuck is, though its heartbeats go on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import httpx

from libs.common.bus import Bus
from libs.common.events import EngineRole, EngineSpec, FaultKind, ListEngines, ListEnginesReply
from tests.agent.conftest import AgentProcess, Recorder, alive, pattern_spec
from tests.support import wait_until

# The first engine of the spec sleeps before it runs the pattern engine (its marker file then exists); the later
# ones start at once. SIGSTOP-free: the process is alive and well, only late.
LATE_FIRST = ("import os, runpy, sys, time\n"
              "marker = sys.argv[1]\n"
              "if not os.path.exists(marker):\n"
              "    open(marker, 'w').close()\n"
              "    time.sleep(float(sys.argv[2]))\n"
              "sys.argv = ['engines.pattern']\n"
              "runpy.run_module('engines.pattern', run_name='__main__', alter_sys=True)\n")


def late_spec(marker: Path, sleep_s: float, cold_start_s: float) -> EngineSpec:
    return EngineSpec(engine_class="pattern", model="late-m", command=[sys.executable, "-c", LATE_FIRST, str(marker),
                                                                       str(sleep_s)],
                      env={"HF_PATTERN_HEARTBEAT_S": "0.05"}, replicas=1, standbys=0, cold_start_s=cold_start_s)


async def test_an_engine_declared_hung_for_connecting_late_is_replaced_not_adopted(
        tmp_path: Path, agent: AgentProcess, recorder: Recorder, bus: Bus) -> None:
    # "never connected" after 2 s; it connects after 4 s, while its slot still waits for a takeover (6 s)
    agent.start([late_spec(tmp_path / "marker", 4.0, 1.0)], takeover_wait_s=6.0)
    fault = await recorder.wait("fault.detected", within_s=30)
    assert fault.kind is FaultKind.HUNG and "never connected" in fault.detail
    replacement = (await recorder.wait("engine.ready", lambda e: e.engine.engine_id != fault.engine_id,
                                       within_s=30)).engine
    assert fault.pid is not None and not alive(fault.pid)  # refused, then killed when its record was retired
    listed = (await bus.request("node-1", ListEngines(), ListEnginesReply)).engines
    live = [e for e in listed if e.role is EngineRole.ACTIVE and e.state in ("starting", "ready")]
    assert [e.engine_id for e in live] == [replacement.engine_id]
    assert not recorder.of("engine.ready", lambda e: e.engine.engine_id == fault.engine_id)
    log = agent.log_dir / "agent.log"
    assert f"adopted engine {fault.engine_id}" not in log.read_text()


async def test_heartbeats_missed_while_starting_are_not_a_hang(agent: AgentProcess, recorder: Recorder,
                                                               bus: Bus) -> None:
    # An engine registered and heartbeating, still loading, whose heartbeats stop for 2.5 s (as an import or a
    # weight load holding its interpreter on a loaded machine would): a slow start-up (the start-up timeout, 10 s
    # by default), not a hang (the serving timeout, 1 s here). Once ready, the same stop is a hang.
    agent.start([pattern_spec(env={"HF_PATTERN_LOAD_S": "8"})], heartbeat_timeout_s=1.0)
    started = (await recorder.wait("engine.started", within_s=30)).engine
    assert started.pid is not None

    async def heartbeating() -> bool:
        listed = (await bus.request("node-1", ListEngines(), ListEnginesReply)).engines
        return any(e.engine_id == started.engine_id and e.heartbeats and e.state == "starting" for e in listed)
    await wait_until(heartbeating)
    os.kill(started.pid, signal.SIGSTOP)
    await asyncio.sleep(2.5)
    os.kill(started.pid, signal.SIGCONT)
    ready = (await recorder.wait("engine.ready", within_s=30)).engine
    assert ready.engine_id == started.engine_id
    assert not recorder.of("fault.detected")
    os.kill(started.pid, signal.SIGSTOP)
    fault = await recorder.wait("fault.detected", within_s=10)
    assert fault.engine_id == started.engine_id and fault.kind is FaultKind.HUNG
    os.kill(started.pid, signal.SIGKILL)


async def test_an_engine_whose_http_server_is_stuck_is_hung_though_it_heartbeats(agent: AgentProcess,
                                                                                  recorder: Recorder) -> None:
    # A gray failure: the engine's server loop blocks for good on one request (a deadlock), while its agent link's
    # thread heartbeats on. Probes of GET /health (every 0.5 s here) find it; a healthy engine is left alone.
    agent.start([pattern_spec(env={"HF_PATTERN_HANG_PROMPT": "HANG"})], probe_interval_s=0.5, probe_timeout_s=0.5,
                probe_failures=3)
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE, within_s=30)).engine
    assert active.endpoint
    await asyncio.sleep(3.0)  # six rounds of probes answered
    assert not recorder.of("fault.detected")

    def stuck_request() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{active.endpoint}/generate", json={"prompt": "HANG", "max_tokens": 4}, timeout=2)
    await asyncio.to_thread(stuck_request)
    fault = await recorder.wait("fault.detected", lambda f: f.engine_id == active.engine_id, within_s=30)
    assert fault.kind is FaultKind.HUNG and "HTTP server" in fault.detail and "heartbeats went on" in fault.detail
