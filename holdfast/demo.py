"""`holdfast demo`: a real model served through a crash, with the timeline of its recovery.

Checks, each of which fails the demo (exit 1, saying which) when it does not hold:
- every request streamed through the router completes, with exactly the tokens of an uninterrupted run
  (greedy decoding: the successor computes on the predecessor's weights, so outputs match);
- the successor's weights hash equals the predecessor's (the memory survived the SIGKILL);
- after a SIGKILL and restart of the gpu_manager itself, the leases are still there and the engine
  still answers the same;
- the incident is resolved;
- then the batched engine under load (bench/load_recovery.py, deterministic mode): 16 streams through the
  router and 4 requests sent during the outage survive a SIGKILL, each with the tokens of the no-failure run,
  the standby adopting every in-flight sequence from the journal, with no prefill token recomputed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from devstack.scenario import PROMPTS, Scenario, detect_backend
from libs.common.events import Tag

console = Console(stderr=True)


def default_size(backend: str) -> str:
    return "1b" if backend == "cuda" else "tiny"


def run(*, json_only: bool = False, size: str = "auto") -> int:
    backend = detect_backend()
    size = default_size(backend) if size == "auto" else size
    sc = Scenario(size=size, backend=backend)
    failures: list[str] = []
    result: dict[str, Any] = {}
    try:
        with console.status(f"[bold]making {size} weights and starting the stack ({backend} backend)..."):
            sc.start()
        result = asyncio.run(_play(sc, failures, json_only))
    except Exception as e:  # noqa: BLE001 - say what broke, exit non-zero
        failures.append(f"{type(e).__name__}: {e}")
        if sc.stack is not None:
            for name in sc.stack.children:
                tail = sc.stack.tail(name, 8)
                if tail:
                    console.print(f"[dim]--- {name} log ---\n{tail}[/dim]")
    finally:
        with console.status("stopping the stack..."):
            sc.stop()
        kept = sc.finish(ok=not failures)
        if kept is not None:
            console.print(f"the stack's logs are kept in {kept}")
    if not failures:
        try:
            with console.status("the batched engine: 16 streams + 4 late requests through a SIGKILL..."):
                result["under_load"] = _under_load(backend, size, failures)
        except Exception as e:  # noqa: BLE001 - say what broke, exit non-zero
            failures.append(f"under load: {type(e).__name__}: {e}")
    result = {"demo": "ok" if not failures else "failed", **result}
    if failures:
        result["failures"] = failures
        for f in failures:
            console.print(f"[red]check failed: {f}[/red]")
    print(json.dumps(result), flush=True)
    return 0 if not failures else 1


async def _play(sc: Scenario, failures: list[str], quiet: bool) -> dict[str, Any]:
    say = (lambda *_: None) if quiet else console.print
    await sc.connect()
    try:
        with console.status("waiting for the engine and its warm standby..."):
            active = await sc.wait_serving()
        say(f"engine [bold]{active.engine_id}[/bold] serving at {active.endpoint} (pid {active.pid}); standby ready")
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            with console.status("baseline: uninterrupted outputs..."):
                baseline = await sc.baseline(client)
            with console.status("streaming requests through the router; SIGKILL of the engine mid-generation..."):
                trial = await sc.failover_trial(client, baseline)
            say(f"SIGKILLed pid {active.pid}; incident {trial.incident_id} resolved")

            with console.status("killing the gpu_manager itself, restarting it..."):
                # The serving engine's leases, once its replacement standby is up too: a lease another engine is
                # still allocating when the manager dies is uncommitted and rightly reclaimed by the restart.
                serving = await sc.wait_serving()
                held_before = await _settled_leases(sc, serving.engine_id)
                assert sc.stack is not None
                sc.stack.kill("gpu_manager")
                sc.stack.restart("gpu_manager")
                await sc.stack.wait_healthy(["gpu_manager"], timeout=60)
                held_after = {lease.id for lease in (await sc.leases()).leases if lease.owner == serving.engine_id}
                again = await sc.generate(client, PROMPTS[0])
            memory_kept = bool(held_before) and held_before <= held_after and again.tokens == baseline[PROMPTS[0]].tokens
            say(f"gpu_manager restarted: {len(held_after)} leases held, engine answers the same: {memory_kept}")
    finally:
        await sc.close()

    with console.status("cold restart of the same engine from its weights file, for comparison..."):
        cold = sc.cold_restart()

    if not quiet:
        _print_timeline(trial.timeline_ms)
    recovery_ms = trial.recovery_ms
    weights_intact = trial.weights_before is not None and trial.weights_before == trial.weights_after
    if trial.lost:
        failures.append(f"{trial.lost} requests lost: {[r.error for r in trial.results if r.error]}")
    if trial.mismatched:
        failures.append(f"{trial.mismatched} outputs differ from the uninterrupted run")
    if not weights_intact:
        failures.append(f"weights hash changed across the takeover ({trial.weights_before} -> {trial.weights_after})")
    if not memory_kept:
        failures.append(f"gpu_manager restart lost leases ({held_before - held_after}) or changed outputs")
    if recovery_ms is None:
        failures.append("no token was served after the kill")
    return {
        "backend": sc.backend, "size": sc.size,
        "detect_ms": _r(trial.timeline_ms.get("detected")), "recovery_ms": _r(recovery_ms),
        "cold_restart_ms": _r(cold["cold_restart_ms"]),
        "speedup": _r(cold["cold_restart_ms"] / recovery_ms) if recovery_ms else None,
        "page_cache_dropped": cold["page_cache_dropped"],
        "weights_intact": weights_intact, "outputs_match": not trial.mismatched and not trial.lost,
        "requests_lost": trial.lost, "memory_kept_across_gpu_manager_restart": memory_kept,
        "timeline_ms": {k: _r(v) for k, v in trial.timeline_ms.items()},
        "steps_ms": {k: _r(v) for k, v in trial.steps_ms().items()},
        "successor": trial.engine_recovery,  # its own clock from the promotion (first generation's phases)
    }


def _under_load(backend: str, size: str, failures: list[str]) -> dict[str, Any]:
    from bench.load_recovery import run as load_run

    report = asyncio.run(load_run(backend=backend, size=size, streams=16, late=4, trials=1, max_tokens=96,
                                  kv_cache_gib=None, work_dir=None))
    out = report["sigkill"]
    succ = out.get("successor") or {}
    if out["lost"] or out["mismatched"]:
        failures.append(f"under load: {out['lost']} requests lost, {out['mismatched']} outputs differ")
    if succ.get("recomputed_prefill_tokens"):
        failures.append(f"under load: the successor recomputed {succ['recomputed_prefill_tokens']} prefill tokens")
    if succ.get("adopted") != [16]:
        failures.append(f"under load: the successor adopted {succ.get('adopted')} sequences, not 16")
    return {"streams": 16, "late": 4, "largest_gap_ms": out["largest_gap_ms"],
            "late_first_token_ms": out["late_first_token_ms"], "no_failure_largest_gap_ms":
            report["no_failure"]["largest_gap_ms"], "lost": out["lost"], "mismatched": out["mismatched"],
            "adopted": succ.get("adopted"), "recomputed_prefill_tokens": succ.get("recomputed_prefill_tokens")}


async def _settled_leases(sc: Scenario, engine_id: str, timeout: float = 30.0) -> set[str]:
    """The leases `engine_id` keeps for itself: once it no longer holds a predecessor's KV cache taken over
    (tag kv_cache, epoch > 1). A promoted shadow reads that cache for the replayed requests (kv_reuse_s) and
    then releases it on its own; a release that falls across the manager's restart is not a lost lease."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        mine = [lease for lease in (await sc.leases()).leases if lease.owner == engine_id]
        donors = [lease for lease in mine if lease.tag == Tag.KV_CACHE and lease.epoch > 1]
        if not donors or asyncio.get_running_loop().time() > deadline:
            return {lease.id for lease in mine}
        await asyncio.sleep(0.2)


def _print_timeline(timeline: dict[str, float]) -> None:
    table = Table(title="recovery timeline (ms after the SIGKILL)")
    table.add_column("step")
    table.add_column("ms", justify="right")
    for k, v in timeline.items():
        table.add_row(k, f"{v:.1f}")
    console.print(table)


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 2)
