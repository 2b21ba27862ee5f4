"""`holdfast chaos`: steady load through the router while faults of every kind are injected at random;
then, once all grace windows have passed, the invariants are checked and reported.

Faults: engine SIGKILL, engine SIGSTOP (hang), engine-reported CUDA error, gpu_manager SIGKILL,
agent SIGKILL, controller-leader SIGKILL (two controllers run), NATS restart, etcd restart. The chaos
run plays the process supervisor (systemd, Kubernetes) for the services it kills: it starts them again.

Invariants, each counted and expected to be 0:
- corrupted: a serving engine's weights hash differs from the hash of the weights file;
- leaked: a lease still held past its deadline with no live owner;
- two_writers: a lease mapped writable by two live (not stopped) engine processes at one sample (host
  backend: read from /proc/<pid>/maps, independent of what the services say; a warm standby's read-only
  shadow of the weights is not a writer);
- lost / wrong: a request that neither completed nor got an explicit error, or completed with tokens
  other than the uninterrupted run's;
- unresolved: an incident neither resolved nor failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console

from libs.cli.scenario import PROMPTS, Scenario, StreamResult, detect_backend
from libs.common import procs
from libs.common.events import EngineInfo, LeaseState

console = Console(stderr=True)

FAULTS = ("engine_sigkill", "engine_sigstop", "engine_cuda_error", "gpu_manager_sigkill", "agent_sigkill",
          "controller_leader_sigkill", "nats_restart", "etcd_restart")
MEMFD_MAP = re.compile(r"/memfd:hf-([\w-]+)-\d+")


def lease_writers(state_dir: Path) -> dict[str, set[int]]:
    """Which live, running engine processes of this stack map each lease writable (from /proc/<pid>/maps)."""
    holders: dict[str, set[int]] = {}
    for pid in procs.pids_with_env("HF_STATE_DIR", str(state_dir), having=("HF_ENGINE_ID",)):
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "TZ":
                continue  # stopped or dead: cannot write
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            m = MEMFD_MAP.search(line)
            if m is not None and line.split()[1][1] == "w":  # perms: r w x s/p
                holders.setdefault(m.group(1), set()).add(pid)
    return holders


def weights_file_hash(path: Path) -> str:
    """What a serving engine's /checksum must equal: the same hash over the file's tensors."""
    from engines.reference.weights import load_weights, weights_sha256

    return weights_sha256(load_weights(path))


@dataclass
class Tally:
    ok: int = 0
    errors: int = 0  # explicit errors (503 after the hold timeout...): answered, not lost
    lost: int = 0
    wrong: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    two_writer_samples: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Chaos:
    def __init__(self, sc: Scenario, rng: random.Random, tally: Tally) -> None:
        self.sc = sc
        self.rng = rng
        self.tally = tally
        self.stop = asyncio.Event()

    @property
    def stack(self) -> Any:
        assert self.sc.stack is not None
        return self.sc.stack

    # ------------------------------------------------------------ load

    async def load(self, client: httpx.AsyncClient, baseline: dict[str, StreamResult], worker: int) -> None:
        i = worker
        while not self.stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            r = await self.sc.generate(client, prompt)
            if r.done and not r.error:
                if r.tokens == baseline[prompt].tokens:
                    self.tally.ok += 1
                else:
                    self.tally.wrong += 1
            elif r.error and (r.error.startswith("HTTP 503") or '"code"' in r.error):
                self.tally.errors += 1
            else:
                self.tally.lost += 1
                self.tally.notes.append(f"lost: {r.error}")

    # ------------------------------------------------------------ two writers, sampled from /proc

    async def watch_mappings(self) -> None:
        state_dir = self.stack.base_dir / "state"
        while not self.stop.is_set():
            holders = await asyncio.to_thread(lease_writers, state_dir)
            for lease, pids in holders.items():
                if len(pids) > 1:
                    self.tally.two_writer_samples.append({"lease": lease, "pids": sorted(pids), "at": time.time()})
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------ faults

    async def active_engine(self) -> EngineInfo | None:
        try:
            engines = await self.sc.engines()
        except Exception:  # noqa: BLE001 - etcd may be restarting
            return None
        ready = [e for e in engines if e.role == "active" and e.state == "ready" and e.pid]
        return ready[0] if ready else None

    async def inject(self, fault: str) -> None:
        self.tally.faults[fault] += 1
        if fault.startswith("engine_"):
            engine = await self.active_engine()
            if engine is None or engine.pid is None:
                self.tally.notes.append(f"{fault}: no ready engine, skipped")
                return
            sig = {"engine_sigkill": signal.SIGKILL, "engine_sigstop": signal.SIGSTOP,
                   "engine_cuda_error": signal.SIGUSR1}[fault]
            os.kill(engine.pid, sig)  # SIGUSR1: the reference engine reports a fatal CUDA error and exits
        elif fault == "controller_leader_sigkill":
            leader = await self._leader()
            name = next((n for n, c in self.stack.children.items() if n.startswith("controller") and leader
                         and str(c.pid) in leader), None) or self.rng.choice(["controller", "controller-2"])
            self.stack.kill(name)
            await asyncio.sleep(0.2)
            await asyncio.to_thread(self.stack.restart, name)
        elif fault in ("gpu_manager_sigkill", "agent_sigkill"):
            name = fault.removesuffix("_sigkill")
            self.stack.kill(name)
            await asyncio.sleep(0.2)
            await asyncio.to_thread(self.stack.restart, name)
        else:  # nats_restart, etcd_restart
            await asyncio.to_thread(self.stack.restart, fault.removesuffix("_restart"))

    async def _leader(self) -> str | None:
        try:
            raw = await self.sc.store.get("leader/controller") if self.sc.store else None
        except Exception:  # noqa: BLE001
            return None
        return raw.decode() if raw else None

    async def settle(self, timeout: float = 60.0) -> bool:
        """Until an engine serves again with a standby beside it."""
        try:
            await self.sc.wait_serving(timeout=timeout)
            return True
        except Exception as e:  # noqa: BLE001 - reported as a note; the invariants say whether it mattered
            self.tally.notes.append(f"not settled: {e}")
            return False


async def _run(sc: Scenario, minutes: float, seed: int, workers: int, min_faults: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    tally = Tally()
    chaos = Chaos(sc, rng, tally)
    await sc.connect()
    assert sc.stack is not None
    # a second controller, so a leader kill has someone to hand over to
    sc.stack.start_service("controller", name="controller-2", env_extra={"HF_API_PORT": "0"})
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            await sc.wait_serving()
            baseline = await sc.baseline(client)
            background = [asyncio.create_task(chaos.load(client, baseline, w)) for w in range(workers)]
            background.append(asyncio.create_task(chaos.watch_mappings()))
            start = time.monotonic()
            end, cap = start + minutes * 60, start + minutes * 60 * 4 + 300  # cap: a machine too slow to reach it
            injected = 0
            while time.monotonic() < end or (injected < min_faults and time.monotonic() < cap):
                injected += 1
                await asyncio.sleep(rng.uniform(2.0, 5.0))
                fault = rng.choice(FAULTS)
                console.print(f"[yellow]inject {fault}[/yellow]")
                await chaos.inject(fault)
                await chaos.settle()
            chaos.stop.set()
            await asyncio.gather(*background, return_exceptions=True)
            return await _check(sc, chaos, tally)
    finally:
        await sc.close()


async def _check(sc: Scenario, chaos: Chaos, tally: Tally) -> dict[str, Any]:
    expected = weights_file_hash(sc.weights)
    engine = await chaos.active_engine()
    served = await sc.weights_checksum(engine.endpoint) if engine and engine.endpoint else None
    leases = (await sc.leases()).leases
    # leaked: held, past the deadline, and still not reclaimed after the reconciler had its chance
    grace_end = max((lease.deadline or 0) for lease in leases) if leases else 0
    await asyncio.sleep(max(0.0, min(grace_end - time.time(), 120.0)) + 2.0)
    leases = (await sc.leases()).leases
    engines = {e.engine_id for e in await sc.engines() if e.pid and procs.pid_alive(e.pid)}
    leaked = [lease.id for lease in leases if lease.state != LeaseState.RECLAIMED and lease.owner not in engines
              and lease.deadline is not None and lease.deadline < time.time()]
    assert sc.store is not None
    incidents = [json.loads(v) for v in (await sc.store.get_prefix("incidents/")).values()]
    unresolved = [i.get("id") or i.get("incident_id") for i in incidents
                  if str(i.get("state", "")).lower() not in ("resolved", "failed")]
    failed = [{"id": i.get("id"), "kind": i.get("kind"), "failure": i.get("failure")}
              for i in incidents if str(i.get("state", "")).lower() == "failed"]
    return {
        "invariants": {
            "corrupted": 0 if served == expected else 1,
            "leaked": len(leaked),
            "two_writers": len(tally.two_writer_samples),
            "lost": tally.lost,
            "wrong": tally.wrong,
            "unresolved": len(unresolved),
        },
        "requests": {"ok": tally.ok, "explicit_errors": tally.errors},
        "faults": dict(tally.faults),
        "incidents": {"total": len(incidents), "failed": len(failed)},
        "details": {"leaked": leaked, "unresolved": unresolved, "failed": failed[:10],
                    "two_writers": tally.two_writer_samples[:5],
                    "notes": tally.notes[:20]},
    }


def cli(
    minutes: float = typer.Option(2.0, help="how long to inject faults"),
    seed: int = typer.Option(1, help="random seed (the same seed, the same faults in the same order)"),
    workers: int = typer.Option(3, help="concurrent client streams"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
    faults: int = typer.Option(0, help="inject at least this many (the run goes on past --minutes until then: a "
                               "loaded machine settles slower)"),
) -> None:
    """Inject faults of every kind at random under load, then check the invariants (all must be 0)."""
    backend = detect_backend()
    sc = Scenario(size="tiny" if backend == "host" else "small", backend=backend)
    try:
        sc.start()
        report = asyncio.run(_run(sc, minutes, seed, workers, faults))
    finally:
        sc.stop()
        sc.discard_weights()
    report = {"chaos": "ok" if not any(report["invariants"].values()) else "violated", "minutes": minutes,
              "seed": seed, "backend": backend, **report}
    print(json.dumps(report) if json_out else json.dumps(report, indent=2))
    if report["chaos"] != "ok":
        raise typer.Exit(1)
