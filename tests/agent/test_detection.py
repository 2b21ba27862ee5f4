"""Each way an engine fails yields exactly one FaultDetected of the right kind (real processes, signals)."""

from __future__ import annotations

import os
import signal

import pytest

from libs.common.bus import Bus
from libs.common.events import FaultKind
from tests.agent.conftest import AgentProcess, Recorder, pattern_spec

CASES = {
    "sigkill": ({}, signal.SIGKILL, FaultKind.KILLED),
    "sigsegv": ({}, signal.SIGSEGV, FaultKind.KILLED),
    "sigstop": ({}, signal.SIGSTOP, FaultKind.HUNG),
    "normal_exit": ({"HF_PATTERN_EXIT_AFTER_S": "0.5", "HF_PATTERN_EXIT_CODE": "3"}, None, FaultKind.EXITED),
    "reported_error": ({"HF_PATTERN_FATAL_AFTER_S": "0.5"}, None, FaultKind.CUDA_ERROR),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_each_failure_yields_exactly_one_event_of_its_kind(case: str, agent: AgentProcess, recorder: Recorder,
                                                                 bus: Bus) -> None:
    env, sig, kind = CASES[case]
    agent.start([pattern_spec(env=env)], takeover_wait_s=0.5)
    ready = await recorder.wait("engine.ready")
    victim = ready.engine
    if sig is not None:
        os.kill(victim.pid, sig)
    fault = await recorder.wait("fault.detected", lambda f: f.engine_id == victim.engine_id)
    assert fault.kind is kind
    assert fault.pid == victim.pid and fault.node == "node-1" and fault.generation == victim.generation
    if kind is FaultKind.KILLED:
        assert fault.signal == sig
    if kind is FaultKind.EXITED:
        assert fault.exit_code == 3
    if kind is FaultKind.HUNG:
        os.kill(victim.pid, signal.SIGKILL)  # the hung engine's later death is the same fault, not a second one
    # Nobody took over within takeover_wait_s: the agent retires the failed engine and starts a replacement.
    await recorder.wait("engine.ready", lambda e: e.engine.engine_id != victim.engine_id)
    stored = [e.data for e in await bus.replay("fault.detected") if e.data.engine_id == victim.engine_id]
    assert len(stored) == 1, stored


@pytest.mark.parametrize("marks", [True, False], ids=["death_mark", "poll"])
async def test_a_sigkill_is_seen_as_it_begins_through_the_engines_death_mark_or_the_poll(
        marks: bool, agent: AgentProcess, recorder: Recorder) -> None:
    """The engine holds 256 MiB, so that its teardown outlasts both ways of seeing it begin (a CUDA engine's lasts
    ~145 ms): the fault says which way saw it. With the agent's `death_marks` off, the mark it sent is ignored; on,
    the poll is slowed to every 5 s here, so that the mark is what sees the death (they race otherwise)."""
    agent.start([pattern_spec(env={"HF_PATTERN_BALLAST_MIB": "256"})], takeover_wait_s=0.5, death_marks=marks,
                exit_poll_ms=5000 if marks else 2)
    victim = (await recorder.wait("engine.ready")).engine
    os.kill(victim.pid, signal.SIGKILL)
    fault = await recorder.wait("fault.detected", lambda f: f.engine_id == victim.engine_id)
    assert fault.kind is FaultKind.KILLED and fault.signal == signal.SIGKILL
    assert fault.detail == f"signal SIGKILL (seen exiting: {'death mark' if marks else 'poll'})"
