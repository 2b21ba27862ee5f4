"""A controller that lost its term between its leader check and its request (a pause, a swap storm) still reaches the
agent: its stop must not run (issue 20: the agent stopped whatever a stop named, and a stale leader's clean-up could
stop an engine the new leader had just routed in). Real agent and engine processes, NATS and etcd; the stale
leader's request is played here (tests/controller/test_stop_term.py checks the real controller's stamp)."""

from __future__ import annotations

import os

import pytest

from libs.common.bus import Bus
from libs.common.errors import RemoteError
from libs.common.events import ListEngines, ListEnginesReply, StopEngine, StopReply
from libs.common.store import Store
from tests.agent.conftest import AgentProcess, Recorder, pattern_spec
from tests.support import ended_then_current_term


async def _live(bus: Bus) -> set[str]:
    listed = await bus.request("node-1", ListEngines(), ListEnginesReply, timeout=10)
    return {e.engine_id for e in listed.engines if e.state in ("starting", "ready")}


async def _refused(bus: Bus, engine_id: str, term: int) -> RemoteError:
    with pytest.raises(RemoteError) as refused:
        await bus.request("node-1", StopEngine(engine_id=engine_id, term=term), StopReply, timeout=10)
    return refused.value


async def test_a_stop_of_an_ended_term_is_refused_and_the_current_terms_and_an_unstamped_one_run(
        agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store) -> None:
    agent.start([pattern_spec(replicas=2, standbys=0)])
    first = await recorder.wait("engine.ready")
    second = await recorder.wait("engine.ready", lambda e: e.engine.engine_id != first.engine.engine_id)
    a, b = first.engine, second.engine
    stale, new = await ended_then_current_term(store)
    current = new.term
    try:
        assert current > stale
        refused = await _refused(bus, a.engine_id, stale)
        assert refused.remote_code == "stale_term"
        assert refused.message == f"sent in controller term {stale}; term {current} leads now"
        assert await _live(bus) == {a.engine_id, b.engine_id}  # nothing stopped
        os.kill(a.pid, 0)  # its process runs

        stopped = await bus.request("node-1", StopEngine(engine_id=a.engine_id, term=current), StopReply, timeout=30)
        assert stopped.engine_id == a.engine_id
        await recorder.wait("engine.stopped", lambda e: e.engine_id == a.engine_id)
    finally:
        await new.resign()
    # nobody leads now: a stop of the term that ended is refused too; an operator's (unstamped) is not checked
    assert (await _refused(bus, b.engine_id, current)).remote_code == "stale_term"
    assert await _live(bus) == {b.engine_id}
    await bus.request("node-1", StopEngine(engine_id=b.engine_id), StopReply, timeout=30)
    assert await _live(bus) == set()
    assert not recorder.of("fault.detected")  # each stop that ran was a stop, and the refused ones did nothing
    log = (agent.log_dir / "agent.log").read_text()
    assert (f"stop of {a.engine_id} refused: stale_term: sent in controller term {stale}; term {current} leads now"
            in log), log[-2000:]
    assert f"stop of {b.engine_id} refused: stale_term: sent in controller term {current}, which has ended" in log
