"""A whole node lost (probe of 2026-12-07): its agent, gpu_manager, fd keeper and engine SIGKILLed together. Before,
nothing reacted: only `nodes/<node>` went (the agent's lease), no incident opened, the dead engine stayed routed and
recorded as serving, and a model whose only replica was there answered 502 until the node came back, while another
node had room. Now the leader faults the lost node's engine (`node_lost`, its memory gone with it) once the node
has been gone `node_lost_s` and the engine does not answer, and the model is cold-started on the other node.

First the case that must not fault: the node's agent and gpu_manager stopped (SIGSTOP) past the node's lease and
`node_lost_s`, its engine still serving: no incident, the engine still routed. Real nats-server, etcd, two nodes of
real services (host backend), a pattern engine, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.stack import Stack, StackConfig
from libs.common import procs
from libs.common.events import EngineSpec
from libs.common.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
MODEL = "lost-m"
NODES = ("node-1", "node-2")
LOST_S = 2.0  # the controller's node_lost_s here (10 s by default)


def engines_file(path: Path, replicas: int) -> Path:
    spec = EngineSpec(engine_class="pattern", model=MODEL, command=[sys.executable, "-m", "engines.pattern"],
                      env={"HF_PATTERN_BYTES": str(4 << 20), "HF_PATTERN_HEARTBEAT_S": "0.05"}, replicas=replicas,
                      standbys=0, cold_start_s=20.0)
    path.write_text(json.dumps([spec.model_dump(mode="json")] if replicas else []))
    return path


class TwoNodes:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.stack = Stack(StackConfig.ephemeral(base_dir=base, backend="host", services=(), node=NODES[0],
                                                 other_nodes=NODES[1:]))

    def state(self, node: str) -> Path:
        return self.base / "state" / node

    def start(self) -> None:
        self.stack.start_infra()
        for node, replicas in zip(NODES, (0, 1), strict=True):  # the model's one replica on node-2
            self.state(node).mkdir(parents=True, exist_ok=True, mode=0o700)
            env = {"HF_NODE": node, "HF_STATE_DIR": str(self.state(node))}
            self.stack.start_service("gpu_manager", name=f"gpu_manager-{node}", env_extra=env)
            self.stack.start_service("agent", name=f"agent-{node}", env_extra={
                **env, "HF_ENGINES_FILE": str(engines_file(self.base / f"engines-{node}.json", replicas))})
        self.stack.start_service("dc_manager")
        self.stack.start_service("controller", env_extra={"HF_NODE_LOST_S": str(LOST_S)})
        self.stack.start_service("router")

    def node_pids(self, node: str) -> list[int]:
        """Every process of the node: its services and what its agent started (engines, the fd keeper), which
        inherit its state directory."""
        return sorted(procs.pids_with_env("HF_STATE_DIR", str(self.state(node))))

    def stop(self) -> None:
        try:
            self.stack.stop()
        finally:
            for node in NODES:
                procs.kill_pids_with_env("HF_STATE_DIR", str(self.state(node)))

    async def generate(self) -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as c:
            return await c.post(f"{self.stack.router_url}/v1/generate", headers=self.stack.router_headers(),
                                json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": False})

    async def api(self, method: str, path: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=15) as c:
            return await c.request(method, f"{self.stack.api_url}{path}",
                                   headers={"Authorization": f"Bearer {self.stack.config.api_token}"})


async def _json(store: Store, prefix: str) -> dict[str, Any]:
    """The keys under `prefix`, JSON values parsed (an endpoint's is its URL)."""
    out: dict[str, Any] = {}
    for k, v in (await store.get_prefix(prefix)).items():
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v.decode()
    return out


async def _until(probe: Any, timeout: float, what: str) -> Any:  # noqa: ANN401
    deadline = time.monotonic() + timeout
    while True:
        got = await probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.3)


async def test_a_lost_node_s_engine_is_faulted_and_cold_started_elsewhere_a_stopped_agent_s_is_not(
        tmp_path: Path) -> None:
    two = TwoNodes(tmp_path)
    try:
        await asyncio.to_thread(two.start)
        store = await Store.connect(two.stack.settings())
        try:
            async def serving() -> dict[str, Any] | None:
                routed = await _json(store, f"endpoints/{MODEL}/")
                eng = [e for e in (await _json(store, "engines/node-2/")).values()
                       if e["role"] == "active" and e["state"] == "ready" and f"endpoints/{MODEL}/{e['engine_id']}" in routed]
                return eng[0] if eng else None

            victim = await _until(serving, 90, "the model served from node-2")
            assert (await two.generate()).status_code == 200

            # The node's agent and gpu_manager stopped past its lease and node_lost_s: its engine still answers
            stopped = [two.stack.children[f"{s}-node-2"].pid for s in ("agent", "gpu_manager")]
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            try:
                await _until(lambda: _gone(store), 15, "node-2's key gone while its agent is stopped")
                log = two.stack.logs / "controller.log"

                async def asked() -> bool:  # the leader took it for a suspect, asked it, and it answered
                    return f"but its engine {victim['engine_id']} answers" in log.read_text()
                await _until(asked, LOST_S + 15, "the stopped node's engine asked")
                assert await _json(store, "incidents/") == {}, "an incident opened for an engine that serves"
                r = await two.generate()
                assert r.status_code == 200 and r.json()["engines"] == [victim["engine_id"]], r.text
            finally:
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
            await _until(lambda: _present(store), 30, "node-2 registered again")

            # The whole node lost: its engine faulted by the leader, the model cold-started on node-1
            t_kill = time.monotonic()
            pids = two.node_pids("node-2")
            for pid in pids:  # all stopped first: the agent reports no death it sees before its own
                os.kill(pid, signal.SIGSTOP)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            inc_id = f"inc-{victim['engine_id']}-g{victim['generation']}"

            async def resolved() -> dict[str, Any] | None:
                rec = (await _json(store, "incidents/")).get(f"incidents/{inc_id}")
                return rec if rec is not None and rec["state"] in ("resolved", "failed") else None

            rec = await _until(resolved, 60, f"{inc_id} ended")
            assert rec["state"] == "resolved" and rec["kind"] == "node_lost" and rec["memory_lost"], rec
            cold = rec["successor_id"]

            async def cold_ready() -> bool:
                return (await _json(store, "engines/node-1/")).get(f"engines/node-1/{cold}", {}).get("state") == "ready"
            await _until(cold_ready, 30, f"{cold} ready on node-1")

            async def ghost_failed() -> bool:  # the dead engine's record outlives it: said failed (no later leader
                key = f"engines/node-2/{victim['engine_id']}"  # takes it for a lost engine again)
                return (await _json(store, "engines/node-2/")).get(key, {}).get("state") == "failed"
            await _until(ghost_failed, 15, "the dead engine's record said failed")
            routed = await _json(store, f"endpoints/{MODEL}/")
            assert list(routed) == [f"endpoints/{MODEL}/{cold}"], routed  # the dead engine routed out
            r = await two.generate()
            assert r.status_code == 200 and r.json()["engines"] == [cold], r.text
            print(f"node lost -> served on node-1 after {time.monotonic() - t_kill:.1f} s")
            # its record outlives it (node-2's agent's to remove): asking to replace it again is refused
            r = await two.api("POST", f"/v1/engines/{victim['engine_id']}/failover")
            assert r.status_code == 409, r.text
            assert [k for k in await _json(store, "incidents/")] == [f"incidents/{inc_id}"]
        finally:
            await store.close()
    finally:
        await asyncio.to_thread(two.stop)


async def _gone(store: Store) -> bool:
    return "nodes/node-2" not in await store.get_prefix("nodes/")


async def _present(store: Store) -> bool:
    return "nodes/node-2" in await store.get_prefix("nodes/")
