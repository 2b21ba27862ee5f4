"""An engine that exits at once is restarted with exponential backoff, and the agent says so."""

from __future__ import annotations

import asyncio

from libs.common.bus import Bus
from libs.common.events import ListEngines, ListEnginesReply
from libs.common.store import Store
from services.agent.supervision import spec_key
from tests.agent.conftest import AgentProcess, Recorder, start_crash_loop

WINDOW_S = 6.0


async def test_an_engine_that_exits_at_once_is_restarted_ever_more_slowly_and_its_backoff_is_listed(
        agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store) -> None:
    spec = await start_crash_loop(agent, store, base_s=1.0)
    first = await recorder.wait("engine.started")
    await asyncio.sleep(WINDOW_S)

    starts = recorder.of("engine.started")
    faults = recorder.of("fault.detected")
    # Without backoff the agent restarts it every reconcile pass (~0.5 s: > 10 starts in the window). With
    # delays 0, 1, 2, 4 s after each exit (plus ~0.1-0.5 s of start and exit each), at most 5 fit.
    assert 3 <= len(starts) <= 5, [s.engine.started_at - first.engine.started_at for s in starts]
    assert all(f.exit_code == 3 for f in faults)
    gaps = [b.engine.started_at - a.engine.started_at for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[-1] > gaps[0]  # ever more slowly

    reply = await bus.request("node-1", ListEngines(), ListEnginesReply, timeout=5)
    (b,) = [b for b in reply.backoff if b.spec_key == spec_key(spec)]
    assert b.failures >= 3 and b.delay_s >= 2.0
