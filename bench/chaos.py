"""`holdfast chaos`: steady load through the router while faults of every kind are injected at random;
then, once all grace windows have passed, the invariants are checked and reported (docs/benchmarks.md, Chaos).

Faults (15 kinds): engine SIGKILL, SIGSTOP (hang), engine-reported CUDA error, an engine SIGKILLed during its
start-up allocation (holding an uncommitted lease), a GPU XID reported through NVML's path, gpu_manager
SIGKILL, fd pressure on the gpu_manager (a hostile same-uid client) with an engine killed under it, agent,
dc_manager, router and controller-leader SIGKILL (two controllers run), NATS restart, etcd restart, etcd
stalled by SIGSTOP for 3-15 s, and large bodies POSTed to the admin API while an engine's incident runs.
Several models run side by side (`--models`, each an active engine and a warm standby) and `--concurrency` faults
are in flight at once: engine faults on different models overlap each other and service faults (a NATS restart
while one model fails over and another's gpu_manager is under fd pressure); a fault holds what it hit until that
serves again (its model serving with its standbys, its service healthy), and two faults never hold one thing
(bench/chaos_lanes.py). A service chaos kills is started again by chaos with the same command line and configuration (as systemd or
Kubernetes would); one that exits on its own is restarted by the stack's supervisor (`Stack.supervise_once`,
what `holdfast up` runs), and counted.

Invariants, each counted and expected to be 0:
- corrupted: a serving engine's weights hash differs from the hash of the weights file;
- leaked: a lease still held past its deadline with no live owner;
- two_writers: a lease mapped writable by two live (not stopped) engine processes at one sample (host
  backend: read from /proc/<pid>/maps, independent of what the services say; a warm standby's read-only
  shadow of the weights is not a writer);
- replicas_exceeded: samples with more serving engines or router endpoints than replicas (chaos_checks.py);
- lost / wrong: a request that neither completed nor got an explicit error, or completed with tokens
  other than the uninterrupted run's (a connection refused or cut while the router itself is down and
  restarting is explicit to its client, and counted apart as router_down);
- unresolved, ended_twice: an incident neither resolved nor failed; one seen open again after it ended,
  or ended both resolved and failed (chaos_checks.py);
- manager_unserved: after fd pressure ended, a fresh client could not get a hello from the gpu_manager.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console

from bench import chaos_faults as cf
from bench.chaos_run import FAULTS, Chaos, Tally
from devstack.scenario import Scenario, detect_backend
from libs.common import procs
from libs.common.errors import HoldfastError
from libs.common.events import LeaseState

console = Console(stderr=True)
REDRAWS = 4  # a random run's draws of another kind when the one drawn would wait (the last one drawn waits)

CUDA_KV_GIB = 2.0  # each batched engine's KV cache on cuda (4 models: 8 engines, 16 GiB)


def weights_file_hash(path: Path) -> str:
    """What a serving engine's /checksum must equal: the same hash over the file's tensors."""
    from engines.reference.weights import load_weights, weights_sha256

    return weights_sha256(load_weights(path))


def plan(rng: random.Random, smoke: bool) -> list[str] | None:
    """A smoke run: every kind once, in a seeded order; otherwise None (kinds drawn at random)."""
    if not smoke:
        return None
    kinds = list(FAULTS)
    rng.shuffle(kinds)
    return kinds


async def _run(sc: Scenario, minutes: float, seed: int, workers: int, min_faults: int = 0, *, gap: float = 3.5,
               smoke: bool = False, concurrency: int = 1, max_minutes: float | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    tally = Tally()
    chaos = Chaos(sc, rng, tally)
    stack = sc.stack
    assert stack is not None
    # GPU faults arrive through NVML's path: the agent runs with the stand-in on its import path (restarted
    # with it, as a deployment would change its environment)
    await sc.connect()
    for model in sc.models:  # engines up first: an agent restart mid-start-up is a fault of its own kind
        await sc.wait_serving(model=model)
    agent = stack.children["agent"]
    agent.env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(cf.NVML_SHIM_DIR),
                                                                    os.environ.get("PYTHONPATH")])),
                      "HF_CHAOS_NVML_SOCKET": chaos.nvml_socket, "HF_NVML": "true"})
    await asyncio.to_thread(stack.restart, "agent")
    assert sc.bus is not None
    for subject in ("incident.resolved", "incident.failed"):
        await sc.bus.subscribe(subject, chaos.on_terminal)
    # a second controller, so a leader kill has someone to hand over to
    stack.start_service("controller", name="controller-2", env_extra={"HF_API_PORT": "0"})
    order = plan(rng, smoke)
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            baselines = {}
            for model in sc.models:
                await sc.wait_serving(model=model)
                baselines[model] = await sc.baseline(client, model)
            background = [asyncio.create_task(chaos.load(client, baselines, w))
                          for w in range(max(workers, len(sc.models)))]
            background += [asyncio.create_task(c) for c in (chaos.watch_mappings(), chaos.watch_replicas(),
                                                             chaos.watch_incidents(), chaos.supervise())]
            start = time.monotonic()
            end = start + minutes * 60
            cap = start + (max_minutes * 60 if max_minutes is not None  # a machine too slow to reach min_faults
                           else max(minutes * 60 * 4, min_faults * 30.0 / concurrency) + 300)
            drawn = 0

            def next_fault() -> str | None:
                nonlocal drawn
                if order is not None:
                    fault = order[drawn] if drawn < len(order) else None
                elif time.monotonic() < cap and (time.monotonic() < end or drawn < min_faults):
                    # a kind whose target another fault holds (the GPU through an XID's recovery, a model failing
                    # over) is drawn again, a few times, rather than left to wait while other kinds could run
                    fault = rng.choice(FAULTS)
                    for _ in range(REDRAWS):
                        if chaos.can_start(fault):
                            break
                        fault = rng.choice(FAULTS)
                else:
                    fault = None
                drawn += fault is not None
                return fault

            async def slot() -> None:
                """Faults one after another, each after a pause of about `gap`; `concurrency` slots run at once,
                and a fault waits for its resources (chaos_lanes.py) while another holds them."""
                while (fault := next_fault()) is not None:
                    await asyncio.sleep(rng.uniform(gap * 0.57, gap * 1.43))
                    await chaos.run_fault(fault)

            await asyncio.gather(*(slot() for _ in range(concurrency)))
            injected_s = time.monotonic() - start
            chaos.stop.set()
            await asyncio.gather(*background, return_exceptions=True)
            report = await _check(sc, chaos, tally)
            report["wall_s"] = round(time.monotonic() - start, 1)
            report["injecting_s"] = round(injected_s, 1)  # the first fault's draw to the last one's settling
            return report
    finally:
        await sc.close()


async def _live_engines(sc: Scenario) -> set[str]:
    return {e.engine_id for e in await sc.engines() if e.pid and procs.pid_alive(e.pid)}


async def _stale_routes(sc: Scenario) -> list[str]:
    assert sc.store is not None
    alive = await _live_engines(sc)
    return sorted(k for k in await sc.store.get_prefix("endpoints/") if k.rsplit("/", 1)[-1] not in alive)


async def _check(sc: Scenario, chaos: Chaos, tally: Tally) -> dict[str, Any]:
    expected = weights_file_hash(sc.weights)
    corrupted = []  # models whose serving engine's weights differ from the file's (or none serves)
    for model in sc.models:
        engine = await chaos.active_engine(model, within_s=60.0)
        served = await sc.weights_checksum(engine.endpoint) if engine and engine.endpoint else None
        if served != expected:
            corrupted.append(model)
    leases = await _leases(sc)
    # leaked: held, past the deadline, and still not reclaimed after the reconciler had its chance
    grace_end = max((lease.deadline or 0) for lease in leases) if leases else 0
    await asyncio.sleep(max(0.0, min(grace_end - time.time(), 120.0)) + 2.0)
    leases = await _leases(sc)
    engines = await _live_engines(sc)
    leaked = [lease.id for lease in leases if lease.state != LeaseState.RECLAIMED and lease.owner not in engines
              and lease.deadline is not None and lease.deadline < time.time()]
    # incidents still open get the longest step's time to end (a cold start may be running)
    deadline = time.monotonic() + 90
    await chaos.snapshot_incidents()
    while chaos.incidents.unresolved() and time.monotonic() < deadline:
        await asyncio.sleep(2.0)
        await chaos.snapshot_incidents()
    tracker = chaos.incidents
    unresolved, failed = tracker.unresolved(), tracker.failed()
    # routes left to engines no longer running once every incident ended: routers keep sending there (a ready
    # handled late once routed a dead engine back in for good, services/controller/engine_routes.py)
    stale = await _stale_routes(sc)
    if stale:  # a route-in's written-behind delete may still be on its way: those that stay
        await asyncio.sleep(5.0)
        stale = sorted(set(stale) & set(await _stale_routes(sc)))
    ended_twice = sorted(set(tracker.reopened) | set(tracker.ended_both_ways()))
    return {
        "invariants": {
            "corrupted": len(corrupted),
            "leaked": len(leaked),
            "two_writers": len(tally.two_writer_samples),
            "replicas_exceeded": len(tally.replica_samples),
            "lost": tally.lost,
            "wrong": tally.wrong,
            "unresolved": len(unresolved),
            "ended_twice": len(ended_twice),
            "manager_unserved": tally.manager_unserved,
            "stale_routes": len(stale),
        },
        "requests": {"ok": tally.ok, "explicit_errors": tally.errors, "router_down": tally.router_down},
        "faults": dict(tally.faults),
        "faults_total": sum(tally.faults.values()),
        "kinds": len(tally.faults),
        "skipped": dict(tally.skipped),
        "stale_routes": stale,
        "incidents": {"total": len(tracker.states), "failed": len(failed),
                      "duplicate_terminal_events": tracker.duplicate_terminal_events()},
        "failover_ms": {k: {"n": len(v), "p50": sorted(v)[len(v) // 2], "max": max(v)}
                        for k, v in tally.failover_ms.items() if v},
        "busy_s": {k: {"n": len(v), "p50": sorted(v)[len(v) // 2], "max": max(v)}
                   for k, v in sorted(tally.busy_s.items()) if v},
        "allocating": dict(tally.allocating),
        "fd_pressure": {k: dict(v) for k, v in tally.pressure.items()},
        "admin_api_statuses": dict(tally.api_statuses),
        "supervisor_restarts": dict(tally.restarts),
        "details": {"corrupted": corrupted, "leaked": leaked, "unresolved": unresolved,
                    "failed": [{"id": i, "kind": tracker.kinds.get(i)} for i in failed[:10]],
                    "ended_twice": ended_twice[:10], "two_writers": tally.two_writer_samples[:5],
                    "replicas_exceeded": tally.replica_samples[:5], "notes": tally.notes[:30]},
    }


def cli(
    minutes: float = typer.Option(2.0, help="how long to inject faults"),
    seed: int = typer.Option(1, help="random seed (the same seed, the same faults in the same order)"),
    workers: int = typer.Option(3, help="concurrent client streams"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
    faults: int = typer.Option(0, help="inject at least this many (the run goes on past --minutes until then: a "
                               "loaded machine settles slower)"),
    gap: float = typer.Option(3.5, help="mean pause between a recovery and the next fault, s (a long run: 1)"),
    smoke: bool = typer.Option(False, help="every kind once, in a seeded order (ignores --minutes/--faults)"),
    out: Path | None = typer.Option(None, help="also write the JSON report to this file"),
    engine: str = typer.Option("reference", help="reference, or batched (engines/batched in deterministic mode: "
                               "its outputs are checked token for token like the reference engine's)"),
    models: int = typer.Option(2, help="models served (each an active engine and a standby): engine faults on "
                               "different models overlap"),
    concurrency: int = typer.Option(3, help="faults in flight at once (each waits for what it needs: "
                                    "bench/chaos_lanes.py)"),
    max_minutes: float | None = typer.Option(None, help="no fault drawn after this, even short of --faults (the "
                                             "faults in flight settle and the end checks run after it)"),
    keep_logs: bool = typer.Option(False, help="keep the stack's work dir (every service's and engine's log) after "
                                   "a run that held every invariant too: to see why an incident failed"),
) -> None:
    """Inject faults of every kind at random under load, then check the invariants (all must be 0)."""
    backend = detect_backend()
    size = "tiny" if backend == "host" else "small"
    if engine == "batched":
        from bench.load_recovery import LoadScenario

        # cuda: a cache of its own size for each engine; by default each would take 85% of the memory free at its
        # start, so the first active left no room for the standbys (an H200 run: a standby "starting" for 180 s)
        kv = None if backend == "host" else CUDA_KV_GIB
        sc: Scenario = LoadScenario(size=size, backend=backend, max_num_seqs=64, kv_cache_gib=kv, models=models)
    elif engine == "reference":
        sc = Scenario(size=size, backend=backend, models=models)
    else:
        raise typer.BadParameter(f"engine: reference or batched, not {engine!r}")
    report: dict[str, Any] | None = None
    try:
        sc.start()
        report = asyncio.run(_run(sc, minutes, seed, workers, faults, gap=gap, smoke=smoke,
                                  concurrency=max(1, concurrency), max_minutes=max_minutes))
    finally:
        sc.stop()
        kept = sc.finish(ok=report is not None and not any(report["invariants"].values()) and not keep_logs)
        if kept is not None:
            print(f"the stack's logs are kept in {kept}", file=sys.stderr)  # noqa: T201
    report = {"chaos": "ok" if not any(report["invariants"].values()) else "violated", "engine": engine, "minutes": minutes,
              "seed": seed, "gap_s": gap, "smoke": smoke, "models": models, "concurrency": concurrency,
              "max_minutes": max_minutes, "faults_wanted": faults,
              "backend": backend, **report}
    text = json.dumps(report)
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(text if json_out else json.dumps(report, indent=2))
    if report["chaos"] != "ok":
        raise typer.Exit(1)


async def _leases(sc: Scenario) -> list[Any]:
    """The gpu_manager's leases, asked until it answers (it may be restarting after the last fault), 60 s at most."""
    deadline = time.monotonic() + 60.0
    while True:
        try:
            return list((await sc.leases()).leases)
        except HoldfastError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)
