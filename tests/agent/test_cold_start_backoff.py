"""A cold start asked from outside (the dc_manager's fallback `Spawn`) waits out its spec's crash-loop backoff, as
the agent's own starts do: refused (typed, `unavailable`) while the spec's engines keep failing at once. Without
it, each cold engine that died at start opened an incident whose fallback spawned the next one at once (chains of
`cs-inc-cs-inc-...`, 1-2 s apart, in the H200 chaos run of 8c81808)."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.bus import Bus
from libs.common.errors import HoldfastError
from libs.common.events import Spawn, SpawnReply
from libs.common.store import Store
from tests.agent.conftest import AgentProcess, Recorder, start_crash_loop


async def test_a_cold_start_of_a_crash_looping_spec_is_refused_until_its_backoff_ends(
        agent: AgentProcess, recorder: Recorder, bus: Bus, store: Store) -> None:
    spec = await start_crash_loop(agent, store, base_s=20.0)
    async with asyncio.timeout(20):  # the first failure is replaced at once; the second starts the backoff (20 s)
        while len(recorder.of("fault.detected")) < 2:
            await asyncio.sleep(0.05)
    started = len(recorder.of("engine.started"))
    with pytest.raises(HoldfastError) as refused:
        await bus.request("node-1", Spawn(spec=spec, engine_id="cs-inc-x-g0", incident_id="inc-x"), SpawnReply,
                          timeout=5)
    assert "keep failing" in str(refused.value)
    await asyncio.sleep(0.5)
    assert len(recorder.of("engine.started")) == started  # nothing started for it
