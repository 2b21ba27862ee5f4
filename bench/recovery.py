"""`holdfast bench recovery`: three ways of serving again after a SIGKILL, side by side in one run.

1. cold restart: a new engine process loads the weights from the safetensors file (plain tensors);
2. fresh-process reattach: no warm standby, so the agent cold-spawns a process that reattaches the
   leased weights (full pipeline: agent, NATS events, controller, dc_manager, router);
3. warm standby takeover through the full pipeline: the standby shadows the active engine (its weights
   mapped read-only, its model built and run before the failure), so it serves as soon as it is assigned;
   (4., with --unshadowed: a warm standby that attaches the leases only at the takeover, for comparison.)
Each is timed from the death to the first token served (through the router for 2 and 3, directly for 1),
on the same machine and the same weights file, with the split by step, weights hashes before and after,
and output identity with an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.stats import pct
from devstack.scenario import Scenario, Trial, detect_backend, make_weights

console = Console(stderr=True)

# Width of the model by backend: bf16 8B-wide layers on a GPU, float32 512-wide on the CPU; from WIDE_FROM_GIB
# on a GPU, 70B-wide layers (a model that large is wider, not 8B's layers stacked ten times deeper: its forward
# would be ~7x as many kernels, and the first token's time theirs rather than the weights' bandwidth's).
BASE_SIZE = {"cuda": "8b", "host": "small"}
WIDE_FROM_GIB = 64.0


def size_for(backend: str, weights_gib: float) -> str:
    """A reference-model size whose weights take about `weights_gib` GiB (more layers of a base width)."""
    if weights_gib <= 0:
        return "small" if backend == "cuda" else "tiny"
    from engines.reference.config import get_config

    base = get_config("70b" if backend == "cuda" and weights_gib >= WIDE_FROM_GIB else BASE_SIZE[backend])
    per_layer = (base.with_layers(2).n_params() - base.with_layers(1).n_params()) * base.bytes_per_param()
    fixed = base.with_layers(0).n_params() * base.bytes_per_param()
    layers = max(1, round((weights_gib * 2**30 - fixed) / per_layer))
    return f"{base.name}@{layers}"


def summarize(values: list[float]) -> dict[str, float | int | None]:
    return pct(values, digits=2, keys=("p50", "p99", "min", "n"))


def _pipeline_way(backend: str, size: str, standbys: int, trials: int, progress: Progress, label: str,
                  shadow: bool = True, weights: Path | None = None, max_seq: int | None = None,
                  secure: bool = True) -> list[Trial]:
    sc = Scenario(size=size, backend=backend, standbys=standbys, shadow=shadow, weights=weights, max_seq=max_seq,
                  secure=secure)
    task = progress.add_task(label, total=trials)
    t0 = time.perf_counter()
    ok = False
    try:
        sc.start()
        console.log(f"{label}: stack serving in {time.perf_counter() - t0:.1f} s (the weights file made or reused)")
        trials_run = asyncio.run(_trials(sc, trials, progress, task, label))
        ok = True
        return trials_run
    finally:
        sc.stop()
        kept = sc.finish(ok)  # its work dir (~60 MB of etcd data) goes after a good run; kept for its logs otherwise
        if kept is not None:
            console.log(f"{label}: the stack's files are kept in {kept}")


def _cold_restarts(backend: str, size: str, trials: int, weights: Path, max_seq: int | None) -> list[dict[str, Any]]:
    """After every stack is gone, so that a cold start has the machine to itself."""
    sc = Scenario(size=size, backend=backend, weights=weights, max_seq=max_seq)
    out = []
    try:
        make_weights(size, weights)
        for i in range(trials):
            out.append(sc.cold_restart())
            console.log(f"cold restart {i + 1}/{trials}: {out[-1]['cold_restart_ms']:.0f} ms")
    finally:
        shutil.rmtree(sc.work_dir, ignore_errors=True)
    return out


async def _trials(sc: Scenario, n: int, progress: Progress, task: Any, label: str) -> list[Trial]:
    await sc.connect()
    out = []
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            await sc.wait_serving()
            baseline = await sc.baseline(client)
            for i in range(n):
                out.append(await sc.failover_trial(client, baseline))
                progress.advance(task)
                # a line per step, not only the live display: a run cut off (a device call's time limit) says
                # how far it got, and a log without a terminal shows it
                console.log(f"{label}: trial {i + 1}/{n}: {out[-1].recovery_ms or float('nan'):.1f} ms")
    finally:
        await sc.close()
    return out


def _p50_by_key(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each numeric key's median over the rows that have it."""
    values: dict[str, list[float]] = {}
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)):
                values.setdefault(k, []).append(float(v))
    return {k: round(statistics.median(v), 2) for k, v in values.items()}


ENGINE_CLOCK = ("first_token_ms", "first_request_ms", "first_request_token_ms")


def _trial_row(t: Trial) -> dict[str, Any]:
    def ms(row: dict[str, Any]) -> dict[str, Any]:
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}

    return {"death_to_first_token_ms": None if t.recovery_ms is None else round(t.recovery_ms, 2),
            "timeline_ms": ms(dict(sorted(t.timeline_ms.items(), key=lambda kv: kv[1]))),
            "successor_first_generation": ms(t.engine_recovery.get("first_generation") or {}),
            "successor_continued": ms(t.engine_recovery.get("continued") or {}),
            "lost": t.lost, "mismatched": t.mismatched}


def _way_report(trials: list[Trial]) -> dict[str, Any]:
    rec = [t.recovery_ms for t in trials if t.recovery_ms is not None]
    return {
        "death_to_first_token_ms": summarize(rec) if rec else None,
        "steps_ms_p50": _p50_by_key([t.steps_ms() for t in trials]),
        # each event's time after the death, by its publisher's clock
        "timeline_ms_p50": dict(sorted(_p50_by_key([t.timeline_ms for t in trials]).items(), key=lambda kv: kv[1])),
        # the successor's own clock, from its assignment (or start)
        "successor_ms_p50": _p50_by_key([{k: t.engine_recovery.get(k) for k in ENGINE_CLOCK} for t in trials]),
        # its first generation's phases (EngineCore.trace_next)
        "successor_first_generation_p50": _p50_by_key([t.engine_recovery.get("first_generation") or {}
                                                       for t in trials]),
        # resumed requests whose prefixes came from the predecessor's KV cache (engines/reference/kv_reuse.py)
        "successor_kv_reused_p50": _p50_by_key([t.engine_recovery.get("kv_reused") or {} for t in trials]),
        # the predecessor's generations in flight resumed before their requests came back (continuation.py):
        # how many, in how long, and whether on the agent's early word (1) or at the promotion (0)
        "successor_continued_p50": _p50_by_key([t.engine_recovery.get("continued") or {} for t in trials]),
        # late wake-ups of a 1 ms sleeper in the promoted standby, with every thread's frame (stall_watch.py)
        "successor_stalls": [t.engine_recovery["stalls"] for t in trials if t.engine_recovery.get("stalls")],
        # every trial on its own: an outlier's timeline and first generation, which the medians above hide
        "per_trial": [_trial_row(t) for t in trials],
        "weights_intact": all(t.weights_before is not None and t.weights_before == t.weights_after for t in trials),
        "outputs_match": all(t.mismatched == 0 for t in trials),
        "requests_lost": sum(t.lost for t in trials),
    }


WAYS = ("standby", "fresh", "cold")


def build_report(head: dict[str, Any], runs: dict[str, list[Trial]], cold: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's JSON from the ways measured so far (all of them at the end; fewer in a partial one)."""
    report = dict(head)
    if cold:
        report["cold_restart"] = {
            "death_to_first_token_ms": summarize([c["cold_restart_ms"] for c in cold]),
            "page_cache_dropped": all(c["page_cache_dropped"] for c in cold),
            "weights_in_memory_fs": any(c["weights_in_memory_fs"] for c in cold)}
    for way in ("fresh_process_reattach", "warm_standby_unshadowed", "warm_standby"):
        if way in runs:
            report[way] = _way_report(runs[way])
    sb = (report.get("warm_standby") or {}).get("death_to_first_token_ms")
    report["speedup_cold_over_standby"] = (
        round(report["cold_restart"]["death_to_first_token_ms"]["p50"] / sb["p50"], 1) if sb and cold else None)
    return report


def cli(
    backend: str = typer.Option("auto", help="host, cuda or auto"),
    weights_gib: float = typer.Option(0.0, help="weights size (0: the demo's model)"),
    trials: int = typer.Option(5, min=1, help="trials of each way"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
    unshadowed: bool = typer.Option(False, help="also a warm standby that attaches only at the takeover"),
    max_seq: int = typer.Option(0, help="KV capacity per slot of every engine (0: the model's); a large model's "
                                "caches must fit beside its weights"),
    ways: str = typer.Option(",".join(WAYS), help="which ways, comma-separated: standby, fresh, cold (a large "
                             "model's ways one run at a time, within a time limit; the speedup needs cold and standby)"),
    weights_dir: Path | None = typer.Option(None, help="make the one weights file here, keep it, and reuse it when "
                                            "it is there already (default: a temporary folder, removed at the end)"),
    partial: Path | None = typer.Option(None, help="also write the report so far here (JSON) each time a way ends: "
                                        "what a run cut off by a time limit had measured"),
    streams: int = typer.Option(0, min=0, help="N > 0: the batched engine under N concurrent streams instead "
                                "(bench/load_recovery.py): per-stream largest gap, late first token, lost, "
                                "mismatched, recomputed prefill, with a no-failure control in the same run"),
    late: int = typer.Option(0, min=0, help="with --streams: requests sent right after each kill"),
    max_tokens: int = typer.Option(96, min=8, help="with --streams: tokens each stream asks for"),
    kv_cache_gib: float = typer.Option(0.0, help="with --streams: the batched engine's KV cache (0: its default)"),
    step_tokens: int = typer.Option(2048, help="with --streams: the engine's token budget of a step"),
    prefill_chunk: int = typer.Option(256, help="with --streams: the engine's largest prefill chunk"),
    client_procs: int = typer.Option(0, min=0, help="with --streams: client processes reading the streams (0: a "
                                     "quarter of the cores, 1 to 8); each reports its loop lag and CPU share"),
    fenced: bool = typer.Option(True, help="with --streams: the standby's fenced takeover (assigned with the kill, "
                                "mapping during the predecessor's teardown); --no-fenced: assigned after its death"),
    shadow: bool = typer.Option(True, help="with --streams: the standby maps the active engine's leases into its "
                                "reservations before the kill (engines/batched/standby.py); --no-shadow: at the takeover"),
    isolated: bool = typer.Option(True, help="with --streams: the fenced standby adopts once the predecessor's threads "
                                  "are exiting, clear of what its queue may still write (engines/batched/isolation.py); "
                                  "--no-isolated: it waits for the queue proven run or the exit"),
    deterministic: bool = typer.Option(True, help="with --streams: the engine in deterministic mode (outputs compared "
                                       "with the control's); --no-deterministic: the default fast mode, where only "
                                       "lost, missing and repeated tokens are checked"),
    kill_successor: bool = typer.Option(False, help="with --streams: a second failure during the recovery: each "
                                        "kill's successor SIGKILLed too, as soon as it serves (its streams in flight; "
                                        "with --gpu-fault: the spare way's spare)"),
    drawn_weights: bool = typer.Option(False, help="with --streams: the weights drawn on the device at the cold load "
                                       "from a header-only file (make-weights --drawn): weights larger than the "
                                       "machine's disk and RAM"),
    gpu_fault: bool = typer.Option(False, help="with --streams: the active engine's GPU fails instead of a SIGKILL (a "
                                   "node of two simulated GPUs, host backend), three ways side by side: its KV "
                                   "from its host backup taken over by a spare on the other GPU, or by a cold "
                                   "engine there, and no backup (a cold start and the router's replay)"),
    tp: int = typer.Option(1, min=1, max=8, help="with --gpu-fault: a tensor-parallel group of this many ranks on "
                           "a node of twice as many GPUs, its last rank's GPU failed; two ways: a spare group takes "
                           "every rank's backup over, or (none) a cold whole group and the router's replay"),
    secure: bool = typer.Option(True, help="auth and TLS on NATS and etcd, as the stack runs them (--no-secure: "
                                "plain servers, to measure what they cost; not with --gpu-fault)"),
) -> None:
    """Cold restart vs fresh-process reattach vs warm standby takeover, after a SIGKILL.

    One weights file serves every way (in $TMPDIR: /dev/shm on a machine whose disk cannot hold it, and the
    output then says the cold restart read it from memory), removed at the end unless --weights-dir."""
    if gpu_fault and not secure:
        raise typer.BadParameter("--no-secure measures a SIGKILL's recovery; the --gpu-fault run is always secured")
    if gpu_fault and not streams:
        raise typer.BadParameter("--gpu-fault needs --streams N")
    if tp > 1 and not gpu_fault:
        raise typer.BadParameter("--tp is a --gpu-fault run's group size")
    if streams and gpu_fault:
        from bench.load_recovery import run_gpu_fault

        backend = detect_backend() if backend == "auto" else backend
        if backend != "host":
            raise typer.BadParameter("--gpu-fault marks a simulated GPU failed: --backend host")
        report = asyncio.run(run_gpu_fault(backend=backend, size=size_for(backend, weights_gib), streams=streams,
                                           late=late, trials=trials, max_tokens=max_tokens,
                                           kv_cache_gib=kv_cache_gib or None, work_dir=weights_dir,
                                           step_tokens=step_tokens, prefill_chunk=prefill_chunk,
                                           client_procs=client_procs, deterministic=deterministic, tp=tp,
                                           kill_successor=kill_successor))
        print(json.dumps(report))
        return
    if streams:
        from bench.load_recovery import run as load_run

        backend = detect_backend() if backend == "auto" else backend
        report = asyncio.run(load_run(backend=backend, size=size_for(backend, weights_gib), streams=streams,
                                      late=late, trials=trials, max_tokens=max_tokens,
                                      kv_cache_gib=kv_cache_gib or None, work_dir=weights_dir,
                                      step_tokens=step_tokens, prefill_chunk=prefill_chunk,
                                      client_procs=client_procs, fenced=fenced, shadow=shadow,
                                      isolated=isolated, deterministic=deterministic,
                                      kill_successor=kill_successor, drawn=drawn_weights, secure=secure))
        print(json.dumps(report))
        return
    chosen = {w.strip() for w in ways.split(",") if w.strip()}
    if not chosen or chosen - set(WAYS):
        raise typer.BadParameter(f"ways: some of {', '.join(WAYS)}, not {ways!r}")
    backend = detect_backend() if backend == "auto" else backend
    size = size_for(backend, weights_gib)
    shared = weights_dir or Path(tempfile.mkdtemp(prefix="holdfast-bench-weights-"))
    shared.mkdir(parents=True, exist_ok=True)
    weights = shared / f"weights-{size}.safetensors"
    common: dict[str, Any] = {"weights": weights, "max_seq": max_seq or None, "secure": secure}
    head: dict[str, Any] = {"backend": backend, "size": size, "weights_gib": weights_gib, "trials": trials,
                            "max_seq": max_seq or None, "secure": secure}
    runs: dict[str, list[Trial]] = {}
    cold: list[dict[str, Any]] = []

    def way_done() -> None:
        if partial is not None:
            partial.write_text(json.dumps(build_report(head, runs, cold)))

    try:
        with Progress(console=console, transient=True) as progress:
            if "standby" in chosen:
                runs["warm_standby"] = _pipeline_way(backend, size, 1, trials, progress, "warm standby takeover",
                                                     **common)
                way_done()
            if "fresh" in chosen:
                runs["fresh_process_reattach"] = _pipeline_way(backend, size, 0, trials, progress,
                                                               "fresh-process reattach", **common)
                way_done()
            if unshadowed:
                runs["warm_standby_unshadowed"] = _pipeline_way(backend, size, 1, trials, progress,
                                                                "warm standby, no shadow", shadow=False, **common)
                way_done()
        if "cold" in chosen:
            cold = _cold_restarts(backend, size, trials, weights, max_seq or None)
            way_done()
    finally:
        if weights_dir is None:
            shutil.rmtree(shared, ignore_errors=True)
    report = build_report(head, runs, cold)
    if json_out:
        print(json.dumps(report))
        return
    table = Table(title=f"recovery after SIGKILL ({backend}, {size}, {trials} trials)")
    for col in ("way", "p50 ms", "p99 ms", "min ms"):
        table.add_column(col)
    for way in ("cold_restart", "fresh_process_reattach", "warm_standby_unshadowed", "warm_standby"):
        if way not in report:
            continue
        s = report[way]["death_to_first_token_ms"]
        if s:
            table.add_row(way, f"{s['p50']:.1f}", f"{s['p99']:.1f}", f"{s['min']:.1f}")
    console.print(table)
    console.print(f"speedup cold / standby (p50): {report['speedup_cold_over_standby']}x")
