"""`holdfast bench detect [--kills N] [--json]`: engine death -> FaultDetected published, over N SIGKILLs, the two
ways an agent sees a death begin side by side: the engine's death mark (libs/common/death_mark.py: a robust futex
the kernel releases as the teardown begins) and the PF_EXITING poll alone (the agent's `death_marks` off).

For each way a throwaway stack (nats-server, etcd, one agent on free loopback ports) runs a lightweight engine
(`engines.pattern` with no memory and no HTTP: no torch). Each round: wait for the engine to be ready,
take the death time right before `os.kill(pid, SIGKILL)`, and stop the clock when a subscriber on the bus
receives the FaultDetected for that engine. The agent then replaces the engine and the next round starts.

Reported per way (milliseconds): `publish` = death -> event received by a subscriber (the figure that matters);
`notice` = death -> the agent's notice (`died_at` in the event), the part the kernel and the event loop take before
the JetStream publish; `agent_cpu_ms_per_s`: the agent's CPU over the measurement, per second of it (the poll
looks at every engine every 2 ms either way; the marks' waiter is a process of its own). `ratio`: the poll's p50
and p99 over the marks'.
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

from bench.controlplane import _cpu_s
from bench.machine import describe
from bench.stats import pct
from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import EngineSpec, Envelope
from libs.common.security.infra import SecureInfra

ROOT = Path(__file__).resolve().parents[1]


def summarize(values: list[float]) -> dict[str, float | int | None]:
    return pct(values, digits=3, keys=("p50", "p99", "min", "max", "mean", "n"))


async def _measure(settings: CommonSettings, kills: int, agent_pid: int) -> dict[str, Any]:
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
    publish, notice, kinds, details = [], [], set(), set()
    cpu0, t0 = _cpu_s(agent_pid), time.monotonic()
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
            details.add(fault.detail)
        cpu_ms_per_s = (_cpu_s(agent_pid) - cpu0) * 1000 / (time.monotonic() - t0)
    finally:
        await bus.close()
    return {"kills": len(publish), "kinds": sorted(kinds), "details": sorted(details),
            "publish_ms": summarize(publish), "notice_ms": summarize(notice),
            "agent_cpu_ms_per_s": round(cpu_ms_per_s, 1)}


WAYS = {"marks": "true", "poll": "false"}  # the agent's HF_DEATH_MARKS


def run(kills: int, ballast_mib: int = 256) -> dict[str, Any]:
    """Both ways, one stack each, marks first; the poll's figures over the marks'. `ballast_mib`: host memory each
    engine holds, so that its teardown is long, as a CUDA engine's is (otherwise a small process's pidfd can say
    dead before either way sees the death begin)."""
    out: dict[str, Any] = {way: run_one(kills, marks, ballast_mib) for way, marks in WAYS.items()}
    out["ratio"] = {f"{k}_{p}": round(out["poll"][f"{k}_ms"][p] / out["marks"][f"{k}_ms"][p], 2)
                    for k in ("publish", "notice") for p in ("p50", "p99")
                    if out["marks"][f"{k}_ms"][p] and out["poll"][f"{k}_ms"][p] is not None}
    out["machine"] = describe()
    out["ballast_mib"] = ballast_mib
    return out


def run_one(kills: int, marks: str, ballast_mib: int) -> dict[str, Any]:
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
                          command=[sys.executable, "-m", "engines.pattern", "--bytes", "0", "--no-http",
                                   "--ballast-mib", str(ballast_mib)])
        (base / "engines.json").write_text(json.dumps([spec.model_dump(mode="json")]))
        env = {**sec.env(), "HF_NATS_URL": settings.nats_url, "HF_ETCD_ENDPOINTS": settings.etcd_endpoints, "HF_NODE": settings.node,
               "HF_STATE_DIR": str(settings.state_dir), "HF_ENGINES_FILE": str(base / "engines.json"),
               "HF_DEATH_MARKS": marks, "HF_TAKEOVER_WAIT_S": "0", "HF_RECONCILE_INTERVAL_S": "0.05", "HF_NVML": "false",
               # every round kills on purpose: the crash-loop backoff would make each restart wait up to 30 s
               "HF_CRASH_BACKOFF_BASE_S": "0.001", "HF_CRASH_BACKOFF_MAX_S": "0.001",
               "HF_LOG_LEVEL": "WARNING",
               # ahead of, not instead of, the caller's path (the device's packages live on it)
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        agent = procs.Child("agent", [sys.executable, "-m", "services.agent"], env=env,
                            log_path=base / "agent.log").start()
        children.append(agent)
        try:
            return asyncio.run(_measure(settings, kills, agent.pid))
        except TimeoutError:
            raise RuntimeError(f"no event in time; agent log: {(base / 'agent.log').read_text()[-2000:]}") from None
    finally:
        for child in reversed(children):
            child.stop()
        procs.kill_pids_with_env("HF_AGENT_SOCKET", str(base / "state" / "agent.sock"))


def cli(kills: int = 100, ballast_mib: int = typer.Option(256, help="host memory each engine holds (a long teardown)"),
        json_out: bool = typer.Option(False, "--json", help="one JSON object on stdout")) -> None:
    """Engine death -> FaultDetected published, through death marks and through the poll: p50 and p99."""
    result = run(kills, ballast_mib)
    if json_out:
        print(json.dumps(result))
        return
    for way in WAYS:
        r = result[way]
        p, n = r["publish_ms"], r["notice_ms"]
        print(f"{way}: {r['kills']} kills ({', '.join(r['kinds'])}), agent CPU {r['agent_cpu_ms_per_s']} ms/s")
        print(f"  death -> FaultDetected received: p50 {p['p50']} ms, p99 {p['p99']} ms (min {p['min']}, "
              f"max {p['max']})")
        print(f"  death -> agent noticed:          p50 {n['p50']} ms, p99 {n['p99']} ms (max {n['max']})")
    print("poll / marks:", ", ".join(f"{k} {v}" for k, v in result["ratio"].items()))


if __name__ == "__main__":
    typer.run(cli)
