"""Takeover latency profile (a benchmark, not a test: pytest collects it only when named on the command line).

    .venv/bin/python -m pytest tests/agent/bench_takeover.py -q -s   # HF_BENCH_ROUNDS=10 by default

Real processes: a gpu_manager (host backend), an agent, pattern engines with one warm standby. Each round
SIGKILLs the active engine, freezes its leases and sends the agent `takeover`, then prints the command's
round trip (Takeover sent -> TakeoverReply), the agent's own timings, and Takeover sent -> engine.reattached
seen here. Medians at the end. Figures were for docs/history/takeover-latency-2026-11-29.md, never asserted.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.common.bus import Bus
from libs.common.events import EngineRole, Freeze, FreezeReply, Takeover, TakeoverReply
from tests.agent.conftest import AgentProcess, Recorder, pattern_spec
from tests.gpu_manager.harness import ManagerProc

ROUNDS = int(os.environ.get("HF_BENCH_ROUNDS", "10"))
NBYTES = int(os.environ.get("HF_BENCH_BYTES", str(64 << 20)))


@pytest.fixture
def gpu_manager(settings_env: dict[str, str]) -> Iterator[ManagerProc]:
    env = {**settings_env, "HF_BACKEND": "host", "HF_CHUNK_MIB": os.environ.get("HF_BENCH_CHUNK_MIB", "2")}
    mgr = ManagerProc(env, Path(settings_env["HF_STATE_DIR"])).start()
    yield mgr
    mgr.stop()


async def test_takeover_latency_profile(gpu_manager: ManagerProc, agent: AgentProcess, recorder: Recorder,
                                        bus: Bus) -> None:
    agent.start([pattern_spec(standbys=1, env={"HF_PATTERN_BYTES": str(NBYTES)})], takeover_wait_s=60)
    rows: list[dict[str, float]] = []
    active = (await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE)).engine
    used = {active.engine_id}
    for i in range(ROUNDS):
        # a warm standby that has not taken over yet (the agent starts a new one after each takeover)
        await recorder.wait("engine.ready", lambda e, u=frozenset(used): e.engine.role is EngineRole.STANDBY
                            and e.engine.engine_id not in u)
        os.kill(active.pid, signal.SIGKILL)
        await recorder.wait("fault.detected", lambda f, a=active: f.engine_id == a.engine_id)
        incident = f"inc-bench-{i}"
        frozen = await bus.request("node-1", Freeze(owner=active.engine_id, incident_id=incident), FreezeReply,
                                   timeout=10)
        t0 = time.perf_counter()
        reply = await bus.request("node-1", Takeover(incident_id=incident, engine_id=active.engine_id,
                                                     transfer_token=frozen.transfer_token), TakeoverReply,
                                  timeout=30)
        t_reply = (time.perf_counter() - t0) * 1000
        await recorder.wait("engine.reattached", lambda e, n=incident: e.incident_id == n)
        t_event = (time.perf_counter() - t0) * 1000
        assert reply.used_standby
        rows.append({"command_ms": t_reply, "event_ms": t_event, **reply.timings_ms})
        print(f"round {i}: command {t_reply:.1f} ms, event {t_event:.1f} ms, agent {reply.timings_ms}")
        active = reply.engine
        used.add(active.engine_id)
    keys = sorted({k for r in rows for k in r})
    print("median over", len(rows), "rounds:", {k: round(statistics.median(r[k] for r in rows if k in r), 2)
                                                for k in keys})
