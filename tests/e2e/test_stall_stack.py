"""The whole stack rides out a stall of any one of its processes but the engines (etcd, nats-server, each service):
SIGSTOPped for 12 s (for etcd, longer than every lease in it: the agent's node key, the controller's leader key), as
a paused VM, a swap storm or a debugger would, then let go. Meanwhile the router keeps serving from what it knows
(unless it is the one stopped); afterwards no process has exited or been restarted, the node key and the leader are
back, no engine was failed over, and a SIGKILLed engine is still recovered by its standby through the whole
pipeline with the same greedy output. Host backend, auth and TLS on, every service a real process."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from devstack.scenario import Scenario

STALL_S = 12.0  # past the node key's TTL (3 s) and the controller's leader key's


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("server", ["etcd", "nats", "agent", "gpu_manager", "controller", "dc_manager", "router"])
async def test_the_stack_outlives_a_stall_and_still_recovers_an_engine(tmp_path: Path, server: str) -> None:
    sc = Scenario(size="tiny", backend="host", standbys=1, work_dir=tmp_path)
    try:
        await asyncio.to_thread(sc.start)
        await sc.connect()
        assert sc.stack is not None and sc.store is not None
        first = await sc.wait_serving(timeout=180)
        async with httpx.AsyncClient() as client:
            before = await sc.generate(client, "an etcd stall", max_tokens=16)
            assert before.done and not before.error, before.error
            services = {name: child.pid for name, child in sc.stack.children.items()}
            stalled = sc.stack.children[server].pid
            assert stalled is not None
            os.kill(stalled, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                if server != "router":  # served meanwhile: the router's table, HTTP to the engine
                    during = await sc.generate(client, "an etcd stall", max_tokens=16)
                    assert during.done and not during.error and during.tokens == before.tokens, during.error
                await asyncio.sleep(max(0.0, STALL_S - (time.monotonic() - t0)))
            finally:
                os.kill(stalled, signal.SIGCONT)
            await asyncio.sleep(8.0)  # leases lost in the stall are noticed and taken again
            dead = [name for name, child in sc.stack.children.items() if not child.alive()]
            assert not dead, f"exited after the stall: {dead} (see {sc.stack.logs})"
            assert {name: child.pid for name, child in sc.stack.children.items()} == services  # none restarted

            async def back() -> bool:
                assert sc.store is not None and sc.stack is not None
                node = await sc.store.get(f"nodes/{sc.stack.config.node}")
                leaders = await sc.store.get_prefix("leader/")
                return node is not None and any(k.endswith("leader/controller") for k in leaders)
            deadline = time.monotonic() + 60
            while not await back():
                assert time.monotonic() < deadline, "the node key or a leader not back 60 s after the stall"
                await asyncio.sleep(0.2)

            active = await sc.wait_serving(timeout=120)
            assert active.engine_id == first.engine_id  # the stall alone failed nothing over
            seen = len(sc.events)
            sc.kill_engine(active)
            await sc.wait_event("incident.resolved", 120, after=seen)
            successor = await sc.wait_serving(standbys=0, timeout=120)
            assert successor.engine_id != active.engine_id
            after = await sc.generate(client, "an etcd stall", max_tokens=16)
        assert after.done and not after.error and after.tokens == before.tokens, after.error
    finally:
        await sc.close()
        await asyncio.to_thread(sc.stop)
