"""The whole stack rides out a stall of any one of its processes but the engines (etcd, nats-server, each service):
each in turn SIGSTOPped for 8 s (for etcd, longer than every lease in it: the agent's node key, the controller's
leader key, 3 s each), as a paused VM, a swap storm or a debugger would, then let go. Meanwhile the router keeps
serving from what it knows (unless it is the one stopped); after each, no process has exited or been restarted, the
node key and the leader are back and no engine was failed over; at the end a SIGKILLed engine is still recovered by
its standby through the whole pipeline with the same greedy output; before that, etcd is killed outright for as
long and started again on its data, and no service ends either. Host backend, auth and TLS on, every service a real process."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from devstack.scenario import Scenario

STALL_S = 8.0  # past the node key's TTL and the controller's leader key's (3 s each)
STALLED = ("gpu_manager", "dc_manager", "controller", "router", "nats", "etcd", "agent")
PROMPT = "a stall"


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_stack_outlives_a_stall_of_each_process_and_still_recovers_an_engine(tmp_path: Path) -> None:
    sc = Scenario(size="tiny", backend="host", standbys=1, work_dir=tmp_path)
    try:
        await asyncio.to_thread(sc.start)
        await sc.connect()
        assert sc.stack is not None
        await sc.wait_serving(timeout=180)
        engines = sorted((e.engine_id, e.pid) for e in await sc.engines())
        async with httpx.AsyncClient() as client:
            before = await sc.generate(client, PROMPT, max_tokens=16)
            assert before.done and not before.error, before.error
            processes = {name: child.pid for name, child in sc.stack.children.items()}
            for server in STALLED:
                await stall(sc, client, server, before.tokens)
                assert {name: child.pid for name, child in sc.stack.children.items()} == processes, server
                active = await sc.wait_serving(timeout=60)  # and its standby
                assert sorted((e.engine_id, e.pid) for e in await sc.engines()) == engines, (
                    f"a stall of {server} failed an engine over (see {sc.stack.logs})")
            # etcd killed outright for longer than the leases, then started again on its data: no service ends
            sc.stack.kill("etcd")
            await asyncio.sleep(STALL_S)
            await asyncio.to_thread(sc.stack.restart, "etcd")
            await back_again(sc, "an etcd kill")
            processes["etcd"] = sc.stack.children["etcd"].pid
            assert {name: child.pid for name, child in sc.stack.children.items()} == processes
            active = await sc.wait_serving(timeout=60)
            seen = len(sc.events)
            sc.kill_engine(active)
            await sc.wait_event("incident.resolved", 120, after=seen)
            successor = await sc.wait_serving(standbys=0, timeout=120)
            assert successor.engine_id != active.engine_id
            after = await sc.generate(client, PROMPT, max_tokens=16)
        assert after.done and not after.error and after.tokens == before.tokens, after.error
    finally:
        await sc.close()
        await asyncio.to_thread(sc.stop)


async def stall(sc: Scenario, client: httpx.AsyncClient, server: str, tokens: list[int]) -> None:
    """SIGSTOP `server` for STALL_S, serving meanwhile where the router runs; then until every process is alive and
    the node key and the controller's leader key are in etcd again."""
    assert sc.stack is not None and sc.store is not None
    pid = sc.stack.children[server].pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        if server != "router":  # served meanwhile: the router's table, HTTP to the engine
            during = await sc.generate(client, PROMPT, max_tokens=16)
            assert during.done and not during.error and during.tokens == tokens, (server, during.error)
        await asyncio.sleep(max(0.0, STALL_S - (time.monotonic() - t0)))
    finally:
        os.kill(pid, signal.SIGCONT)
    await back_again(sc, f"a stall of {server}")


async def back_again(sc: Scenario, after: str) -> None:
    """Until every process is alive and the node key and the controller's leader key are in etcd again."""
    assert sc.stack is not None and sc.store is not None
    deadline = time.monotonic() + 60
    while True:
        dead = [name for name, child in sc.stack.children.items() if not child.alive()]
        assert not dead, f"exited after {after}: {dead} (see {sc.stack.logs})"
        try:
            node = await sc.store.get(f"nodes/{sc.stack.config.node}")
            leaders = await sc.store.get_prefix("leader/")
        except Exception:  # noqa: BLE001 - this test's own client, reconnecting to a restarted etcd
            node, leaders = None, {}
        if node is not None and any(k.endswith("leader/controller") for k in leaders):
            break
        assert time.monotonic() < deadline, f"the node key or the leader not back 60 s after {after}"
        await asyncio.sleep(0.2)
    await asyncio.sleep(2.0)  # what it would set off (a hang declared, a lease lost) has had time to show
