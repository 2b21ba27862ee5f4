"""`holdfast bench detect [--kills N] [--json]`: engine death -> FaultDetected published, over N SIGKILLs.

A throwaway stack (nats-server, etcd, one agent on free loopback ports) runs a lightweight engine
(`engines.pattern` with no memory and no HTTP: no torch). Each round: wait for the engine to be ready,
take the death time right before `os.kill(pid, SIGKILL)`, and stop the clock when a subscriber on the bus
receives the FaultDetected for that engine. The agent then replaces the engine and the next round starts.

Reported (milliseconds): `publish` = death -> event received by a subscriber (the figure that matters);
`notice` = death -> the agent's pidfd callback (`died_at` in the event), the part the kernel and the
event loop take before the JetStream publish.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer

from bench.stats import pct
from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import EngineSpec, Envelope
from libs.common.security.infra import SecureInfra

ROOT = Path(__file__).resolve().parents[1]


def summarize(values: list[float]) -> dict[str, float | int | None]:
    return pct(values, digits=3, keys=("p50", "p99", "min", "max", "mean", "n"))


async def _measure(settings: CommonSettings, kills: int) -> dict[str, Any]:
    bus = await Bus.connect(settings, "bench-detect")
    ready: asyncio.Queue[Any] = asyncio.Queue()
    faults: dict[str, tuple[float, Any]] = {}
    got_fault = asyncio.Event()

    async def on_ready(env: Envelope) -> None:
        await ready.put(env.data.engine)  # type: ignore[union-attr]

    async def on_fault(env: Envelope) -> None:
        faults[env.data.engine_id] = (time.time(), env.data)  # type: ignore[union-attr]
        got_fault.set()

    await bus.subscribe("engine.ready", on_ready)
    await bus.subscribe("fault.detected", on_fault)
    publish, notice, kinds = [], [], set()
    try:
        for _ in range(kills):
            engine = await asyncio.wait_for(ready.get(), 60)
            await asyncio.sleep(0.05)  # let the engine's start-up work settle: measure detection, not contention
            got_fault.clear()
            died = time.time()
            os.kill(engine.pid, signal.SIGKILL)
            while engine.engine_id not in faults:
                await asyncio.wait_for(got_fault.wait(), 10)
                got_fault.clear()
            seen, fault = faults[engine.engine_id]
            publish.append((seen - died) * 1000)
            notice.append(((fault.died_at or seen) - died) * 1000)
            kinds.add(fault.kind.value)
    finally:
        await bus.close()
    return {"kills": len(publish), "kinds": sorted(kinds), "publish_ms": summarize(publish),
            "notice_ms": summarize(notice)}


def run(kills: int) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="hf-bench-detect-"))
    nats_port, etcd_port, peer = procs.free_port(), procs.free_port(), procs.free_port()
    children: list[procs.Child] = []
    try:
        sec = SecureInfra(base / "state" / "credentials", ["bench-node"])  # auth and TLS, as the stack runs
        settings = sec.settings(nats_url=f"nats://127.0.0.1:{nats_port}", etcd_endpoints=f"127.0.0.1:{etcd_port}",
                                node="bench-node", state_dir=base / "state")
        nats = procs.nats_server(nats_port, base / "nats", base / "nats.log",
                                 config=sec.nats_config(base / "nats.conf", settings)).start()
        children.append(nats)
        etcd = procs.etcd_server(etcd_port, peer, base / "etcd", base / "etcd.log", tls_flags=sec.etcd_flags()).start()
        children.append(etcd)
        procs.wait_port(nats_port, nats)
        procs.wait_port(etcd_port, etcd)
        sec.etcd_ready(etcd_port, settings)
        spec = EngineSpec(engine_class="pattern", model="detect-bench", replicas=1, standbys=0, cold_start_s=10,
                          command=[sys.executable, "-m", "engines.pattern", "--bytes", "0", "--no-http"])
        (base / "engines.json").write_text(json.dumps([spec.model_dump(mode="json")]))
        env = {**sec.env(), "HF_NATS_URL": settings.nats_url, "HF_ETCD_ENDPOINTS": settings.etcd_endpoints, "HF_NODE": settings.node,
               "HF_STATE_DIR": str(settings.state_dir), "HF_ENGINES_FILE": str(base / "engines.json"),
               "HF_TAKEOVER_WAIT_S": "0", "HF_RECONCILE_INTERVAL_S": "0.05", "HF_NVML": "false",
               # every round kills on purpose: the crash-loop backoff would make each restart wait up to 30 s
               "HF_CRASH_BACKOFF_BASE_S": "0.001", "HF_CRASH_BACKOFF_MAX_S": "0.001",
               "HF_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
        agent = procs.Child("agent", [sys.executable, "-m", "services.agent"], env=env,
                            log_path=base / "agent.log").start()
        children.append(agent)
        try:
            result = asyncio.run(_measure(settings, kills))
        except TimeoutError:
            raise RuntimeError(f"no event in time; agent log: {(base / 'agent.log').read_text()[-2000:]}") from None
        result["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
        return result
    finally:
        for child in reversed(children):
            child.stop()
        procs.kill_pids_with_env("HF_AGENT_SOCKET", str(base / "state" / "agent.sock"))


def cli(kills: int = 100, json_out: bool = typer.Option(False, "--json", help="one JSON object on stdout")) -> None:
    """Engine death -> FaultDetected published: p50 and p99 over many SIGKILLs."""
    result = run(kills)
    if json_out:
        print(json.dumps(result))
        return
    p, n = result["publish_ms"], result["notice_ms"]
    print(f"{result['kills']} kills ({', '.join(result['kinds'])})")
    print(f"death -> FaultDetected received: p50 {p['p50']} ms, p99 {p['p99']} ms (min {p['min']}, max {p['max']})")
    print(f"death -> agent noticed (pidfd):  p50 {n['p50']} ms, p99 {n['p99']} ms")


if __name__ == "__main__":
    typer.run(cli)
