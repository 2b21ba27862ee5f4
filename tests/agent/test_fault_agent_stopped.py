"""The agent SIGSTOPped for longer than its engines' heartbeat timeout and its node key's ttl (a paused VM, a swap
storm), and one of its two engines SIGKILLed meanwhile: once the agent runs again, the dead engine yields exactly one
fault, of the right kind (killed, not hung), and the engine that kept running is not failed over for the silence
the agent itself caused."""

from __future__ import annotations

import asyncio
import os
import signal

from libs.common.bus import Bus
from libs.common.events import FaultKind
from libs.common.store import Store
from tests.agent.conftest import AgentProcess, Recorder, pattern_spec

PAUSE_S = 8.0  # past the heartbeat timeout (1 s here) and the node key's ttl (2 s)


async def test_an_agent_resumed_from_a_stop_reports_only_the_engine_that_died_meanwhile(
        agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store) -> None:
    agent.start([pattern_spec(replicas=2)], takeover_wait_s=0.5)
    first = await recorder.wait("engine.ready")
    second = await recorder.wait("engine.ready", lambda e: e.engine.engine_id != first.engine.engine_id)
    victim, survivor = first.engine, second.engine
    assert agent.child is not None
    os.kill(agent.child.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(1.0)
        os.kill(victim.pid, signal.SIGKILL)
        await asyncio.sleep(PAUSE_S)
    finally:
        os.kill(agent.child.pid, signal.SIGCONT)
    fault = await recorder.wait("fault.detected", lambda f: f.engine_id == victim.engine_id, within_s=20)
    assert fault.kind is FaultKind.KILLED and fault.signal == signal.SIGKILL, fault
    await asyncio.sleep(5.0)  # long enough for the survivor's silence to be judged, if it were
    faults = [e.data for e in await bus.replay("fault.detected")]
    assert [f.engine_id for f in faults] == [victim.engine_id], faults
    assert agent.child.alive()
    os.kill(survivor.pid, 0)  # still running
