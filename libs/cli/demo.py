"""`holdfast demo`: a real model served through a crash, with the timeline of its recovery.

Checks, each of which fails the demo (exit 1, saying which) when it does not hold:
- every request streamed through the router completes, with exactly the tokens of an uninterrupted run
  (greedy decoding: the successor computes on the predecessor's weights, so outputs match);
- the successor's weights hash equals the predecessor's (the memory survived the SIGKILL);
- after a SIGKILL and restart of the gpu_manager itself, the leases are still there and the engine
  still answers the same;
- the incident is resolved.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from libs.cli.scenario import PROMPTS, TIMELINE_EVENTS, Scenario, detect_backend

console = Console(stderr=True)


def default_size(backend: str) -> str:
    return "small" if backend == "cuda" else "tiny"


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
        assert active.endpoint
        say(f"engine [bold]{active.engine_id}[/bold] serving at {active.endpoint} (pid {active.pid}); standby ready")
        before_sum = await sc.weights_checksum(active.endpoint)

        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            with console.status("baseline: uninterrupted outputs..."):
                baseline = {p: (await sc.generate(client, p)) for p in PROMPTS}
            for r in baseline.values():
                if r.error or not r.done:
                    raise RuntimeError(f"baseline request failed: {r.error}")

            with console.status("streaming requests; killing the engine mid-generation..."):
                streams = [asyncio.create_task(sc.generate(client, p)) for p in PROMPTS]
                await _until_tokens(sc, streams, want=4)
                t_kill = sc.kill_engine(active)
                late = [asyncio.create_task(sc.generate(client, p)) for p in PROMPTS[:2]]  # sent during the outage
                results = await asyncio.gather(*streams, *late)
                resolved = await sc.wait_event("incident.resolved", 60)
            say(f"SIGKILLed pid {active.pid}; incident {resolved.incident_id} resolved")

            lost = [r for r in results if r.error or not r.done]
            mismatched = [r for r in results if not r.error and r.tokens != baseline[r.prompt].tokens]
            after_kill = [t for r in results for t in r.arrivals if t > t_kill]
            first_token = min(after_kill) if after_kill else None

            successor = await sc.wait_serving(standbys=0, timeout=30)
            assert successor.endpoint
            after_sum = await sc.weights_checksum(successor.endpoint)

            with console.status("killing the gpu_manager itself, restarting it..."):
                held_before = {lease.id for lease in (await sc.leases()).leases}
                assert sc.stack is not None
                sc.stack.kill("gpu_manager")
                sc.stack.restart("gpu_manager")
                await sc.stack.wait_healthy(["gpu_manager"], timeout=60)
                held_after = {lease.id for lease in (await sc.leases()).leases}
                again = await sc.generate(client, PROMPTS[0])
            memory_kept = held_before <= held_after and again.tokens == baseline[PROMPTS[0]].tokens
            say(f"gpu_manager restarted: {len(held_after)} leases held, engine still answers the same: {memory_kept}")
    finally:
        await sc.close()

    with console.status("cold restart of the same engine from its weights file, for comparison..."):
        cold = sc.cold_restart()

    timeline = _timeline(sc, t_kill, first_token)
    if not quiet:
        _print_timeline(timeline)
    detect_ms = timeline.get("detected")
    recovery_ms = (first_token - t_kill) * 1000.0 if first_token else None
    weights_intact = before_sum is not None and before_sum == after_sum
    if lost:
        failures.append(f"{len(lost)} requests lost: {[r.error for r in lost]}")
    if mismatched:
        failures.append(f"{len(mismatched)} outputs differ from the uninterrupted run")
    if not weights_intact:
        failures.append(f"weights hash changed across the takeover ({before_sum} -> {after_sum})")
    if not memory_kept:
        failures.append(f"gpu_manager restart lost leases ({held_before - held_after}) or changed outputs")
    if recovery_ms is None:
        failures.append("no token was served after the kill")
    return {
        "backend": sc.backend, "size": sc.size,
        "detect_ms": _r(detect_ms), "recovery_ms": _r(recovery_ms), "cold_restart_ms": _r(cold["cold_restart_ms"]),
        "speedup": _r(cold["cold_restart_ms"] / recovery_ms) if recovery_ms else None,
        "page_cache_dropped": cold["page_cache_dropped"],
        "weights_intact": weights_intact, "outputs_match": not mismatched and not lost,
        "requests_lost": len(lost), "memory_kept_across_gpu_manager_restart": memory_kept,
        "timeline_ms": {k: _r(v) for k, v in timeline.items()},
    }


async def _until_tokens(sc: Scenario, tasks: list[asyncio.Task[Any]], want: int) -> None:
    """Wait until the router has streamed `want` more tokens, so the kill lands mid-generation."""
    start = sc.tokens_streamed
    deadline = time.monotonic() + 60
    while sc.tokens_streamed - start < want:
        if any(t.done() for t in tasks):
            raise RuntimeError("a stream ended before the kill; raise max_tokens")
        if time.monotonic() > deadline:
            raise TimeoutError("no tokens streamed within 60 s")
        await asyncio.sleep(0.005)


def _timeline(sc: Scenario, t_kill: float, first_token: float | None) -> dict[str, float]:
    out: dict[str, float] = {"death": 0.0}
    for at, env in sc.events:
        label = TIMELINE_EVENTS.get(env.type)
        if label and at >= t_kill and label not in out:
            out[label] = (at - t_kill) * 1000.0
    if first_token:
        out["first token after recovery"] = (first_token - t_kill) * 1000.0
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def _print_timeline(timeline: dict[str, float]) -> None:
    table = Table(title="recovery timeline (ms after the SIGKILL)")
    table.add_column("step")
    table.add_column("ms", justify="right")
    for k, v in timeline.items():
        table.add_row(k, f"{v:.1f}")
    console.print(table)


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 2)
