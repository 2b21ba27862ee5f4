"""An engine's standby takes over while the control plane cannot act: the whole stack (nats, etcd, gpu_manager,
agent with a warm standby that shadows the active batched engine and fences itself, controller, dc_manager, router;
host backend, the tiny model, real processes, auth and TLS on), the controller and the dc_manager SIGSTOPped, the
active engine SIGKILLed. The node's agent (`promote_locally` on) freezes the dead engine's leases itself and promotes the standby
(services/agent/takeover.py `promote`): it serves a request straight away, with the control plane still stopped.
Let go, the controller opens the incident, the dc_manager's freeze finds the leases handed on and its takeover joins
the agent's: the incident resolves with that standby as successor, one active engine serves through the router, and
a request's greedy output is the one before the kill."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.load_recovery import LoadScenario
from tests.gpu_manager.harness import until

PROMPT = "the control plane is asleep"


async def _generate_at(client: httpx.AsyncClient, endpoint: str) -> list[int]:
    """Greedy tokens straight from an engine (no router: nobody routes while the control plane is stopped)."""
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True, "temperature": 0.0, "ignore_eos": True}
    tokens: list[int] = []
    async with client.stream("POST", f"{endpoint}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200, (await r.aread()).decode(errors="replace")
        async for line in r.aiter_lines():
            if line.strip():
                msg = json.loads(line)
                tokens += msg.get("tokens") or ([msg["token"]] if "token" in msg else [])
    return tokens


@pytest.mark.timeout(300)
async def test_the_agent_promotes_a_shadowing_standby_while_controller_and_dc_manager_are_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_PROMOTE_LOCALLY", "true")  # the agent's setting (off by default), through the stack's env
    sc = LoadScenario(size="tiny", backend="host", standbys=1, max_num_seqs=16, kv_cache_gib=None, work_dir=tmp_path)
    await asyncio.to_thread(sc.start)
    stopped: list[int] = []
    try:
        await sc.connect()
        assert sc.stack is not None
        active = await sc.wait_serving()  # its standby shadows it already (LoadScenario waits for that on the CPU)
        [standby] = [e for e in await sc.engines() if e.role == "standby" and e.shadows == active.engine_id]
        assert active.endpoint and standby.endpoint
        async with httpx.AsyncClient() as client:
            before = await _generate_at(client, active.endpoint)
            assert len(before) == 8
            for name in ("controller", "dc_manager"):
                pid = sc.stack.children[name].pid
                assert pid is not None
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            seen = len(sc.events)
            sc.kill_engine(active)

            async def taken_over() -> dict[str, Any] | None:
                try:
                    health = await sc.engine_health(standby.endpoint or "")
                except httpx.HTTPError:
                    return None
                return health if health.get("state") == "ready" and health.get("role") == "active" else None

            health = await until(taken_over)
            assert health["recovery"]["source"] == "takeover" and health["recovery"]["shadowed"]
            during = await _generate_at(client, standby.endpoint)
            assert during == before  # the same weights, handed on: the same greedy output
            assert not any(env.type == "incident.resolved" for _, env in sc.events[seen:])  # nobody else acted
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
            stopped.clear()
            resolved = await sc.wait_event("incident.resolved", 60, after=seen)
            assert resolved.data.successor_id == standby.engine_id
            successor = await sc.wait_serving(standbys=0, timeout=60)
            assert successor.engine_id == standby.engine_id
            actives = [e for e in await sc.engines() if e.role == "active" and e.state == "ready"]
            assert [e.engine_id for e in actives] == [standby.engine_id]
            after = await sc.generate(client, PROMPT, max_tokens=8)
            assert after.done and not after.error and after.tokens == before, after.error
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        await sc.close()
        await asyncio.to_thread(sc.stop)
