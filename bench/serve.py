"""`holdfast bench serve --concurrency 1,16,64,256`: what the batched engine serves, per user and in all.

One engine process (the batched engine, local memory: serving speed, not recovery) gets, at each concurrency
c, c streams at once (distinct prompts of ~`prompt_len` tokens, `max_tokens` each, ignore_eos). Reported per c:
output tokens/s, time to first token p50/p99/max, inter-token latency p50/p99 (every gap of every stream) and
each stream's largest gap (p50/p99/max), and beside them the decode roofline of that run: the bytes a decode
step must read (all weights + the KV of every running sequence) over the memory bandwidth measured in the same
run (a device-to-device copy on CUDA; on the CPU a large tensor copy), as tokens/s and as the share reached.
With --plain, a plain torch batched decode of the same model (contiguous KV, SDPA, no paging, no scheduler,
bench/plain_decode.py) runs at the same batch sizes in the same run, for the ratio. With --tp 2,1 each mode runs at
each tensor-parallel size (`<mode>@tp<N>`, one after the other in one run): a group of N against the N-1 ranks a
degraded successor serves on (engines/batched/degrade.py; on one GPU add `--engine-args --tp-one-gpu`). With
--kv-backup each mode runs
again with the engine's KV backup to host on (`<mode>+kv_backup`, the same levels, one after the other in one run),
with the backup's own figures (rounds, bytes, the lag) from the engine's /health.

The streams are read by the serving benches' one client (bench/load_client.py): worker processes whose readers
stamp each token with the kernel's receive time, so the figures are the engine's, not a busy client loop's (one
process reading 256 streams through httpx took 87 us of CPU a line and could bind the figure). Each row's
`client` says whether the client kept up: its loops' lateness and each worker's CPU share. `wall_s` runs from
the first request sent to the last token's arrival.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import typer

from bench.load_client import ClientPool, Job, default_client_procs
from bench.stats import pct
from devstack.scenario import make_weights

ENGINE_PATH = "/generate"  # the engine's own route: no router, no model name in the body


def measure_bandwidth(device: str) -> float:
    """Bytes/s of a large copy (read + write counted), the best of five."""
    import torch

    dev = torch.device(device)
    n = (1 << 30) if dev.type == "cuda" else (1 << 27)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        b.copy_(a)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = max(best, 2 * n / (time.perf_counter() - t0))
    del a, b
    return best


def max_model_len(size: str) -> int:
    from engines.reference.config import get_config

    return get_config(size).max_seq


def roofline_tokens_s(size: str, batch: int, ctx: int, bandwidth: float) -> float:
    from engines.reference.config import get_config

    cfg = get_config(size)
    wbytes = cfg.n_params() * cfg.bytes_per_param()
    kv_per_token = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * cfg.bytes_per_param()
    step_s = (wbytes + batch * ctx * kv_per_token) / bandwidth
    return batch / step_s


class EngineProcess:
    def __init__(self, weights: Path, size: str, work: Path, extra: list[str]) -> None:
        self.ready = work / "serve-engine.ready.json"
        self.ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "engines.batched", "--weights", str(weights), "--size", size, "--memory", "local",
                "--agent", "off", "--ready-file", str(self.ready), *extra]
        self.log = (work / "serve-engine.log").open("w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine did not start: {Path(self.log.name).read_text()[-3000:]}")
            time.sleep(0.1)
        return json.loads(self.ready.read_text())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def stream_prompts(c: int, prompt_len: int) -> list[str]:
    return [(f"user {i}: " + "tell me about holdfast and failures " * 64)[:prompt_len] for i in range(c)]


def serve_row(c: int, runs: list[tuple[float, list[float]]]) -> dict[str, Any]:
    """One concurrency's figures from each stream's (request sent, token arrivals), all on one wall clock."""
    firsts = [a[0] for _, a in runs if a]
    lasts = [a[-1] for _, a in runs if a]
    t0 = min((sent for sent, _ in runs), default=0.0)
    wall = max(max(lasts, default=t0) - t0, 1e-9)
    tokens = sum(len(a) for _, a in runs)
    ttft = [(a[0] - sent) * 1000 for sent, a in runs if a]
    gaps = [(b - a) * 1000 for _, arr in runs for a, b in zip(arr, arr[1:], strict=False)]
    largest = [max((b - a) * 1000 for a, b in zip(arr, arr[1:], strict=False)) for _, arr in runs if len(arr) > 1]
    # decode-only throughput: tokens after each stream's first, over the time from the last first token on
    decode_from = max(firsts, default=t0)
    decode_tokens = sum(sum(1 for a in arr if a > decode_from) for _, arr in runs)
    decode_end = max(lasts, default=decode_from)
    return {"concurrency": c, "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 1),
            "decode_tokens_per_s": round(decode_tokens / (decode_end - decode_from), 1) if decode_end > decode_from else None,
            "ttft_ms": pct(ttft), "itl_ms": pct(gaps), "largest_gap_ms": pct(largest)}


def client_health(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the client kept up: its worker loops' lateness (a 5 ms ticker's) and each worker's CPU share."""
    return {"procs": len(workers), "loop_lag_ms": pct([lag for w in workers for _, lag in w["lags"]]),
            "cpu_share": [w["cpu_share"] for w in workers]}


async def step_times(url: str) -> dict[str, Any]:
    """The engine's step thread so far (engines/batched/pipeline.py `StepTimes`): steps and ms per phase."""
    async with httpx.AsyncClient(timeout=30) as client:
        times = (await client.get(url + "/health")).json()["engine"]["step_times"]
    return {"steps": times["steps"], **times["total_ms"]}


def per_step(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The step thread's ms per step between two `step_times`, per phase: schedule + launch + resolve are its
    own work (the interpreter's), wait is for the device's tokens. Wait near 0 with host work near the step's
    length: the host bounds the rate, not the GPU."""
    steps = after["steps"] - before["steps"]
    out: dict[str, Any] = {"steps": steps}
    for phase in ("schedule", "launch", "wait", "resolve"):
        out[phase] = round((after[phase] - before[phase]) / steps, 3) if steps else None
    return out


def burst_row(sent: int, got: list[tuple[float, Any]]) -> dict[str, Any]:
    """The refused requests of a burst: how many got their 400, how long each took (send to the answer's end)."""
    refused = [r for _, r in got if (r.error or "").startswith("HTTP 400")]
    answered = [r.ended_at - at for at, r in got if r.ended_at]
    return {"sent": sent, "refused_400": len(refused), "other": len(got) - len(refused),
            "answered_ms": pct([a * 1000 for a in answered], keys=("n", "p50", "p99", "max"))}


async def at_concurrency(pool: ClientPool, c: int, prompt_len: int, max_tokens: int,
                         engine_url: str | None = None, *, burst: int = 0,
                         burst_len: int = 0) -> dict[str, Any]:
    """`c` streams at once through the pool; a stream that fails fails the run (its error said). With
    `engine_url`, the row has the engine's step-thread figures over the level (`engine_step_ms`). With `burst`,
    that many requests whose context (`burst_len` bytes) no model takes are sent once every stream has its first
    tokens: each costs the engine's HTTP side its parse and its 400, and the streams' gaps say what that cost them."""
    jobs = [Job(i, p, max_tokens) for i, p in enumerate(stream_prompts(c, prompt_len))]
    before = await step_times(engine_url) if engine_url else None
    await pool.start(jobs, warm_tokens=4 if burst else 0)
    pool.send_late([Job(c + i, "x" * burst_len, 1) for i in range(burst)])
    got, workers = await pool.results()
    after = await step_times(engine_url) if engine_url else None
    streams = {k: v for k, v in got.items() if k < c}
    failed = sorted((k, r.error or "no closing line") for k, (_, r) in streams.items() if r.error or not r.done)
    if failed:
        raise RuntimeError(f"{len(failed)} of {c} streams failed; stream {failed[0][0]}: {failed[0][1]}")
    row = serve_row(c, [(sent, r.arrivals) for sent, r in streams.values()])
    row["client"] = client_health(workers)
    if before is not None and after is not None:
        row["engine_step_ms"] = per_step(before, after)
    if burst:
        row["burst"] = burst_row(burst, [v for k, v in got.items() if k >= c])
    return row


async def run_levels(url: str, levels: list[int], prompt_len: int, max_tokens: int, procs: int, size: str,
                     bandwidth: float, mode: str, burst: int = 0) -> list[dict[str, Any]]:
    """A warm-up, then one row per concurrency, each printed to stderr as it comes."""
    pool = ClientPool(url, None, procs, path=ENGINE_PATH, timeout_s=600)
    try:
        await at_concurrency(pool, min(4, max(levels)), prompt_len, 8, url)  # warm-up
        rows = []
        for c in levels:
            row = await at_concurrency(pool, c, prompt_len, max_tokens, url, burst=burst,
                                       burst_len=max_model_len(size) + 16)
            roof = roofline_tokens_s(size, c, prompt_len + max_tokens // 2, bandwidth)
            row["roofline_tokens_per_s"] = round(roof, 1)
            row["share_of_roofline"] = round((row["decode_tokens_per_s"] or 0) / roof, 3)
            rows.append(row)
            print(json.dumps({"mode": mode, **row}), file=sys.stderr)
        return rows
    finally:
        pool.close()


def cli(
    size: str = typer.Option("auto", help="model size (auto: 8b on CUDA, tiny on the CPU)"),
    concurrency: str = typer.Option("1,16,64,256", help="comma-separated stream counts"),
    prompt_len: int = typer.Option(128, min=1, help="prompt length in bytes (tokens)"),
    max_tokens: int = typer.Option(256, min=2, help="tokens each stream generates"),
    deterministic: bool = typer.Option(False, help="the engine's batch-invariant mode"),
    both_modes: bool = typer.Option(False, help="run default and deterministic mode side by side"),
    plain: bool = typer.Option(False, help="also a plain torch batched decode at the same batch sizes"),
    kv_backup: bool = typer.Option(False, help="each mode also with the engine's KV backup to host (--kv-backup), "
                                   "side by side: `<mode>+kv_backup`, with the backup's own figures"),
    engine_args: str = typer.Option("", help="extra engine flags, space-separated"),
    weights_dir: Path | None = typer.Option(None, help="make/reuse the weights file here"),
    drawn_weights: bool = typer.Option(False, help="a header-only weights file, its values drawn on the device at "
                                       "each load (make-weights --drawn): no 16 GiB file to write first"),
    burst: int = typer.Option(0, min=0, help="at each level, this many requests too long for the model sent while "
                              "the streams decode (each refused with 400): what a flood of bad requests costs them"),
    tp: str = typer.Option("1", help="comma-separated tensor-parallel sizes, each run as its own mode side by side "
                           "(`<mode>@tp<N>`): a group against a degraded one of fewer ranks"),
    client_procs: int = typer.Option(0, min=0, help="client processes reading the streams (0: a quarter of the "
                                     "cores, 1 to 8)"),
) -> None:
    """Output tokens/s, TTFT, inter-token latency and the roofline, at several concurrencies."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if size == "auto":
        size = "8b" if device == "cuda" else "tiny"
    try:
        levels = [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{concurrency!r} is not a comma-separated list of stream counts",
                                 param_hint="--concurrency") from None
    if not levels or min(levels) < 1:
        raise typer.BadParameter("give at least one stream count, each at least 1", param_hint="--concurrency")
    try:
        sizes = [int(x) for x in tp.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{tp!r} is not a comma-separated list of group sizes", param_hint="--tp") from None
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter("give at least one group size, each at least 1", param_hint="--tp")
    work = weights_dir or Path(tempfile.mkdtemp(prefix="holdfast-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    weights = make_weights(size, work / f"weights-{size}{'-drawn' if drawn_weights else ''}.safetensors",
                           drawn=drawn_weights)
    bandwidth = measure_bandwidth(device)
    report: dict[str, Any] = {"bench": "serve", "size": size, "device": device, "prompt_len": prompt_len,
                              "max_tokens": max_tokens, "bandwidth_gb_s": round(bandwidth / 1e9, 1), "modes": {}}
    modes = [False, True] if both_modes else [deterministic]
    runs = [(d, b, n) for d in modes for b in ([False, True] if kv_backup else [False]) for n in sizes]
    for det, backup, ranks in runs:
        extra = ["--max-num-seqs", str(max(levels)), "--max-num-batched-tokens", str(max(2048, max(levels))),
                 *(["--deterministic"] if det else []), *(["--kv-backup"] if backup else []),
                 *(["--tp", str(ranks)] if ranks > 1 else []), *engine_args.split()]
        mode = (("deterministic" if det else "default") + ("+kv_backup" if backup else "")
                + (f"@tp{ranks}" if len(sizes) > 1 else ""))
        eng = EngineProcess(weights, size, work, extra)
        try:
            url = eng.wait()["endpoint"]
            report["modes"][mode] = asyncio.run(run_levels(url, levels, prompt_len, max_tokens,
                                                           client_procs or default_client_procs(), size, bandwidth,
                                                           mode, burst))
            if backup:  # rounds, bytes copied, the lag each round bounded (engines/batched/backup.py)
                report.setdefault("kv_backup", {})[mode] = httpx.get(url + "/health", timeout=30).json().get("kv_backup")
        finally:
            eng.stop()
    if plain:
        from bench.plain_decode import run_plain

        report["plain_decode"] = run_plain(weights, size, levels, ctx=512)
    print(json.dumps(report))
