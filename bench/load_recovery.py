"""`holdfast bench recovery --streams N --late M`: recovery of a loaded batched engine, measured per user.

The real stack (nats, etcd, gpu_manager, agent with one batched engine and one warm standby, dc_manager,
controller, router) serves N concurrent streams through the router. In each trial the active engine is
SIGKILLed once every stream has tokens, and M new requests are sent right after the kill. The same load with
no failure runs first in the same run, as the control. Reported, side by side:
- per stream, the largest gap between two consecutive tokens (p50 / p99 / max over streams and trials);
- the M late requests' time to first token (p50 / p99 / max);
- lost requests (an error, no end, or not exactly the tokens asked for: EOS is ignored, so a token lost or
  repeated at the failover shows there), mismatched outputs (tokens unlike the control's: by default the engine
  runs in deterministic mode, so a stream's tokens do not depend on what ran beside it; `deterministic=False`
  measures the default fast mode, whose outputs depend on the batch, so `mismatched` is not compared there);
- prefill tokens the successor recomputed (requests replayed that it did not hold; goal 0), the sequences it
  adopted from the journal, and its memory (the standby holds no KV of its own before the failure);
- the client's own health (`client`): the streams are read by worker processes (bench/load_client.py) that stamp
  each token with the kernel's receive time; each worker's loop lag and CPU share, and how long after its arrival
  a token was parsed, say whether the client kept up (one in-loop httpx reader did not, at 64 + 16 streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import stats
from bench.load_client import ClientPool, Job, default_client_procs
from bench.machine import describe
from devstack.scenario import MODEL, Scenario, StreamResult, make_weights, router_marks
from devstack.stack import Stack, StackConfig
from libs.common.events import EngineInfo, EngineSpec, MarkGpu, MarkGpuReply

COLD_START_S = 120.0  # the spec's cold_start_s: how long a cold engine may take to start


@dataclass
class Stream(StreamResult):
    """One user's stream as the load client read it: `arrivals` are kernel receive times, `parsed` when the
    client parsed each token; `sent_at` times its first token."""

    sent_at: float = 0.0
    want: int = 0  # tokens asked for (EOS ignored: a done stream has exactly these)
    parsed: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # the engine's first-token phases (its closing line)
    router: dict[str, float] = field(default_factory=dict)  # the router's marks (relay.py `router_ms`)
    router_at: float | None = None  # when the router's relay had it (unix time: one machine, one clock)

    def largest_gap_ms(self) -> float | None:
        if len(self.arrivals) < 2:
            return None
        return max(b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)) * 1000

    def first_token_ms(self) -> float | None:
        return (self.arrivals[0] - self.sent_at) * 1000 if self.arrivals else None


def batched_command(weights: Path, size: str, *, max_num_seqs: int, kv_cache_gib: float | None,
                    step_tokens: int = 2048, prefill_chunk: int = 256, fenced: bool = True,
                    shadow: bool = True, isolated: bool = True, deterministic: bool = True) -> list[str]:
    """The engine, by default in deterministic mode (outputs comparable with the control's; `deterministic=False`:
    the default fast mode, the mode a deployment serves in); `step_tokens` bounds a step's
    prefill, hence how long one step can hold every stream's next token. `fenced`: its standby's fenced takeover
    (config.py `fenced_takeover`); off, the standby is assigned once the predecessor's death is confirmed.
    `shadow`: a prepared standby maps the active engine's leases into its reservations before the failure.
    `isolated`: a fenced standby adopts while the dead engine's queue may still run (engines/batched/isolation.py)."""
    argv = [sys.executable, "-m", "engines.batched", "--weights", str(weights), "--size", size,
            *(["--deterministic"] if deterministic else []),
            "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max(step_tokens, max_num_seqs)),
            "--prefill-chunk", str(prefill_chunk)]
    if not fenced:
        argv.append("--no-fenced-takeover")
    if not shadow:
        argv.append("--no-shadow")
    if not isolated:
        argv.append("--no-isolated-takeover")
    if kv_cache_gib:
        argv += ["--kv-cache-gib", str(kv_cache_gib)]
    return argv


class LoadScenario(Scenario):
    """The demo's scenario with the batched engine. Its standby shadows the active engine (engines/batched/standby.py)
    where it can prepare (a KV cache of a configured size, or the CPU), unless `shadow` is False."""

    def __init__(self, *, max_num_seqs: int, kv_cache_gib: float | None, step_tokens: int = 2048,
                 prefill_chunk: int = 256, fenced: bool = True, shadow: bool | None = None, isolated: bool = True,
                 deterministic: bool = True, router_hold_s: float | None = None, drawn: bool = False,
                 gpus: int = 1, kv_backup: bool = False, spares: int = 0, tp: int = 1, **kw: Any) -> None:
        self.router_hold_s = router_hold_s  # the router's hold for a model with no endpoint (None: its default)
        # `gpus` > 1: the node's GPUs (the host backend simulates them); `kv_backup`: the engine's KV backed up to host;
        # `spares`: the spec's (EngineSpec.spares: standbys on the other GPUs with weights of their own); `tp`: its
        # ranks (a group: its bases every `tp` GPUs)
        self.gpus, self.kv_backup, self.spares, self.tp = gpus, kv_backup, spares, tp
        if shadow is None:
            shadow = kv_cache_gib is not None or kw.get("backend") == "host"
        super().__init__(shadow=shadow, **kw)
        self.drawn = drawn  # the weights drawn at the cold load, from a header-only file (no file of their size)
        if drawn and self.weights.parent == self.work_dir:
            self.weights = self.weights.with_suffix(".drawn.safetensors")
        self.max_num_seqs, self.kv_cache_gib = max_num_seqs, kv_cache_gib
        self.step_tokens, self.prefill_chunk, self.fenced = step_tokens, prefill_chunk, fenced
        self.isolated, self.deterministic = isolated, deterministic

    def start(self) -> Stack:
        self.weights.parent.mkdir(parents=True, exist_ok=True)
        make_weights(self.size, self.weights, drawn=self.drawn)
        spec = EngineSpec(engine_class="batched", model=MODEL,
                          command=batched_command(self.weights, self.size, max_num_seqs=self.max_num_seqs,
                                                  kv_cache_gib=self.kv_cache_gib, step_tokens=self.step_tokens,
                                                  prefill_chunk=self.prefill_chunk, fenced=self.fenced,
                                                  shadow=self.shadow, isolated=self.isolated,
                                                  deterministic=self.deterministic)
                          + (["--kv-backup", "--kv-backup-lag-ms", "100"] if self.kv_backup else []),
                          replicas=1, standbys=self.standbys, cold_start_s=COLD_START_S,
                          gpus=list(range(0, self.gpus, self.tp)), spares=self.spares, tp=self.tp,
                          # the successor's HTTP loop watched (`loop_late`; HF_ENGINE_LOOP_WATCH_S=0: not)
                          env={"HF_ENGINE_LOOP_WATCH_S": os.environ.get("HF_ENGINE_LOOP_WATCH_S", "0.5")})
        specs_file = self.write_specs(spec)
        # the router's loop watched (its late wake-ups on the timeline: `loop_late_near`)
        env = {"HF_ROUTER_LOOP_WATCH_MS": "2"}
        if self.gpus > 1:
            env["HF_GPUS"] = json.dumps([str(g) for g in range(self.gpus)])
        if self.router_hold_s is not None:
            env["HF_HOLD_TIMEOUT_S"] = str(self.router_hold_s)
        self.stack = Stack(StackConfig.ephemeral(base_dir=self.work_dir / "stack", backend=self.backend,
                                                 engines_file=specs_file, extra_env=env, secure=self.secure))
        self.stack.start(timeout=180)
        return self.stack


def prompts(n: int, prefix: str) -> list[str]:
    return [f"{prefix} {i}: a user of a loaded engine asks about failover number {i * 7919 % 1000}" for i in range(n)]


def pct(values: list[float]) -> dict[str, float | int | None]:
    return stats.pct(values, digits=2, keys=("n", "p50", "p99", "max"))


async def standby_gpu_mib(sc: LoadScenario) -> dict[str, int] | None:
    """GPU memory of each process of the warm standby and of the active engine, by nvidia-smi (None without one):
    the standby holds its CUDA context and kernels, no weights and no KV cache of its own."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    r = await asyncio.to_thread(subprocess.run, ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                                 "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                timeout=30)
    used = {int(p): int(m) for p, m in (line.split(",") for line in r.stdout.strip().splitlines() if "," in line)}
    out = {}
    for e in await sc.engines():
        if e.pid in used and e.state in ("standby", "ready"):
            out[f"{e.role}:{e.engine_id}"] = used[e.pid]
    return out


async def kill_when_ready(sc: LoadScenario, standby: EngineInfo, timeout: float = 120.0) -> dict[str, Any]:
    """A second failure during the recovery: the standby that takes the first kill over SIGKILLed as soon as its
    /health says it serves (the streams it adopted in flight, resuming). Its engine id, pid and the kill's wall time."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await c.get(f"{standby.endpoint}/health", timeout=5)
                if r.json().get("state") == "ready":
                    return {"engine_id": standby.engine_id, "pid": standby.pid, "t_kill": sc.kill_engine(standby)}
            await asyncio.sleep(0.002)
    raise TimeoutError(f"standby {standby.engine_id} did not serve within {timeout:.0f} s")


async def serving_besides(sc: LoadScenario, gone: set[str], timeout: float = 180.0) -> EngineInfo:
    """The active engine serving once neither of `gone` is it."""
    deadline = time.monotonic() + timeout
    while True:
        active = await sc.wait_serving(standbys=0, timeout=max(1.0, deadline - time.monotonic()))
        if active.engine_id not in gone:
            return active
        if time.monotonic() > deadline:
            raise TimeoutError(f"still {active.engine_id} serving after {timeout:.0f} s")
        await asyncio.sleep(0.05)


Fault = Callable[[LoadScenario, EngineInfo], Awaitable[float]]
Prepare = Callable[[LoadScenario, EngineInfo], Awaitable[None]]


async def gpus_replaced(sc: LoadScenario, active: EngineInfo, *, spares: int = 0, timeout: float = 300.0) -> None:
    """Before a GPU fault's round (no stream yet): every GPU of the node but the active engine's marked healthy (the
    one an earlier trial failed: replaced), then, with `spares`, until that many spares stand by (one restarted on
    the replaced GPUs after the last trial's took over)."""
    assert sc.bus is not None and sc.stack is not None
    node = sc.stack.config.node
    for gpu in range(sc.gpus):
        if gpu not in active.gpus:
            await sc.bus.request(node, MarkGpu(gpu=gpu, healthy=True, detail="replaced"), MarkGpuReply, timeout=10)
    deadline = time.monotonic() + timeout
    while spares and len([e for e in await sc.engines() if e.spare and e.state == "standby"]) < spares:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {spares} spares standing by after {timeout:.0f} s: {await sc.engines()}")
        await asyncio.sleep(0.1)


async def gpu_fault(sc: LoadScenario, active: EngineInfo, *, backed_rows: int = 0) -> float:
    """The active engine's GPU (a group's: its last rank's) marked failed (what an NVML XID does: its weights and
    cache lost with it).
    `backed_rows`: first wait until the engine's KV backup vouches for that many sequences (a sequence admitted within
    the backup's lag, 100 ms, is not in it yet: replayed and prefilled again, as without a backup). The fault's wall
    time."""
    assert sc.bus is not None and sc.stack is not None
    if backed_rows:
        await sc.until_backed_up(active.endpoint or "", rows=backed_rows, timeout=30)
    node = sc.stack.config.node
    at = time.time()
    await sc.bus.request(node, MarkGpu(gpu=active.gpus[-1], detail="xid 79 (bench)"), MarkGpuReply, timeout=10)
    return at


async def one_round(sc: LoadScenario, client: httpx.AsyncClient, pool: ClientPool, n: int, late: int,
                    max_tokens: int, *, kill: bool, warm_tokens: int, kill_successor: bool = False,
                    fault: Fault | None = None, prepare: Prepare | None = None) -> dict[str, Any]:
    """`kill`: a failure once every stream has tokens, a SIGKILL of the active engine unless `fault` says what;
    `prepare`: what a failure's round needs before its streams start."""
    active = await sc.wait_serving(timeout=300)
    if kill and prepare is not None:
        await prepare(sc, active)
    seen = len(sc.events)
    jobs = [Job(i, p, max_tokens) for i, p in enumerate(prompts(n, "stream"))]
    late_jobs = [Job(n + i, p, max_tokens // 2) for i, p in enumerate(prompts(late, "late"))]
    router_before = await sc.router_stats(client)
    await pool.start(jobs, warm_tokens)
    standby_mib = await standby_gpu_mib(sc) if kill else None
    standby = None
    if kill and kill_successor:  # the warm standby that will take over (with one standby, the only one)
        standby = next(e for e in await sc.engines() if e.role == "standby" and e.state == "standby" and e.endpoint)
    t_kill = (await fault(sc, active) if fault is not None else sc.kill_engine(active)) if kill else time.time()
    pool.send_late(late_jobs)
    second = asyncio.create_task(kill_when_ready(sc, standby)) if standby is not None else None
    try:
        got, workers = await pool.results()
    except BaseException:
        if second is not None:  # the round failed: no kill left pending behind it
            second.cancel()
        raise
    streams, lates = ([_stream(j, *got[j.key]) for j in js] for js in (jobs, late_jobs))
    out: dict[str, Any] = {"streams": streams, "late": lates, "t_kill": t_kill, "standby_gpu_mib": standby_mib,
                           "workers": workers}
    if second is not None:
        killed = await second
        # the streams still open at the second kill: what it tested (tokens of theirs came after it)
        killed["streams_after_kill"] = sum(any(t > killed["t_kill"] for t in s.arrivals) for s in streams + lates)
        killed["after_first_ms"] = (killed["t_kill"] - t_kill) * 1000
        out["second_kill"] = killed
    router_after = await sc.router_stats(client)
    out["router_spares"] = router_after.get("spare_connections")
    out["router_cpu_us_a_line"] = cpu_a_line(router_before, router_after)
    if kill:
        if second is not None:  # the second incident's successor: neither engine killed
            successor = await serving_besides(sc, {active.engine_id, out["second_kill"]["engine_id"]})
        else:
            await sc.wait_event("incident.resolved", 120, after=seen)
            successor = await sc.wait_serving(standbys=0, timeout=120)
        out["successor"] = await sc.engine_health(successor.endpoint or "")
        # the successor's tokens: after it was ready (the predecessor's last tokens still come after the kill, and
        # a fenced standby is assigned with it)
        t_from = _ready(out)
        after = [t for s in streams for t in s.arrivals if t > t_from]
        resumed = [min((t for t in s.arrivals if t > t_from), default=None) for s in streams]
        rec = out["successor"].get("recovery") or {}
        marks: dict[str, float] = {}
        if isinstance(rec.get("t0_wall"), (int, float)):
            marks["successor assigned"] = (rec["t0_wall"] - t_kill) * 1000
            for key, label in (("ready_ms", "successor ready"), ("first_request_ms", "successor first request")):
                if isinstance(rec.get(key), (int, float)):
                    marks[label] = marks["successor assigned"] + rec[key]
        times = (out["successor"].get("engine") or {}).get("step_times") or {}
        origin = times.get("origin_wall")
        if isinstance(origin, (int, float)):  # its first passes' ends: where its first tokens were made
            for first in times.get("first") or []:
                if first["at_step"] <= 2:
                    marks[f"successor step {first['at_step']} ended"] = (origin - t_kill) * 1000 + first["ended_ms"]
        rstats = await sc.router_stats(client)
        marks.update(router_marks(rstats.get("route_ins") or [], successor.engine_id, t_kill))
        out["router_loop_late"] = {**loop_late_near(rstats.get("loop_late") or [], t_kill),
                                   "gc_paused_ms_since_start": rstats.get("gc_paused_ms")}
        timeline, out["detected_as"] = sc.timeline(t_kill, min(after) if after else None, after=seen)
        out["timeline_ms"] = {**timeline, **marks,
                              "last stream resumed": (max(r for r in resumed if r) - t_kill) * 1000 if any(resumed) else None}
    return out


def cpu_a_line(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """The router's CPU (all its threads) per token line relayed over a round: from its /stats `cpu_s` and `lines`
    (a round's other work, its requests' starts and the route-in, counted in)."""
    lines = after.get("lines", 0) - before.get("lines", 0)
    if lines <= 0 or "cpu_s" not in after or "cpu_s" not in before:
        return None
    return round((after["cpu_s"] - before["cpu_s"]) / lines * 1e6, 1)


def loop_late_near(late: list[list[float]], t_kill: float, span_s: float = 0.25) -> dict[str, Any]:
    """The router's late wake-ups (services/router `loop_late`: wall time, ms late, CPU ms its loop ran meanwhile)
    in the `span_s` after the kill: how long its loop was held in all, the longest hold, and the five longest as
    (ms after the kill, ms late, CPU ms: near the lateness, the loop was busy; far below, not run)."""
    near = [((at - t_kill) * 1000, ms, cpu) for at, ms, cpu in late if t_kill <= at <= t_kill + span_s]
    worst = sorted(near, key=lambda x: -x[1])[:5]
    return {"sum_ms": round(sum(ms for _, ms, _ in near), 1), "max_ms": max((ms for _, ms, _ in near), default=0.0),
            "cpu_ms": round(sum(cpu for _, _, cpu in near), 1),
            "worst": [(round(at, 1), ms, cpu) for at, ms, cpu in sorted(worst)]}


def _stream(job: Job, sent_at: float, r: Any) -> Stream:
    return Stream(job.prompt, text=r.text, tokens=r.tokens, arrivals=r.arrivals, error=r.error, done=r.done,
                  sent_at=sent_at, want=job.max_tokens, parsed=r.parsed, phases=r.final.get("first_token_phases_ms") or {},
                  router=r.final.get("router_ms") or {}, router_at=r.final.get("router_received_at"))


def client_report(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the client kept up: its loops' lateness (all ticks, and the worst from 50 ms before each kill to 1 s
    after), CPU share per worker, how long after its arrival each token was parsed, and the largest gap per stream
    as a reader stamping at parse time would have seen it (the earlier client's way)."""
    lags = [lag for r in rounds for w in r["workers"] for _, lag in w["lags"]]
    near = [lag for r in rounds for w in r["workers"] for at, lag in w["lags"] if r["t_kill"] - 0.05 <= at <= r["t_kill"] + 1]
    streams = [s for r in rounds for s in r["streams"] + r["late"]]
    delay = [(p - a) * 1000 for s in streams for a, p in zip(s.arrivals, s.parsed, strict=True)]
    gaps = [max(b - a for a, b in zip(s.parsed, s.parsed[1:], strict=False)) * 1000
            for r in rounds for s in r["streams"] if len(s.parsed) > 1]
    return {"procs": len(rounds[0]["workers"]) if rounds else 0, "timestamps": "kernel receive (SO_TIMESTAMPNS)",
            "loop_lag_ms": pct(lags), "loop_lag_max_near_kill_ms": round(max(near), 2) if near else None,
            "cpu_share": [w["cpu_share"] for r in rounds for w in r["workers"]],
            "parse_after_arrival_ms": pct(delay), "largest_gap_ms_if_stamped_at_parse": pct(gaps)}


def released_after_ready(rec: dict[str, Any]) -> float | None:
    """ms from the successor's ready to its HTTP loop seeing it (`woken_ms`: the held requests go on then); None
    where no request was held. Tens of ms: the loop did not run meanwhile (docs/engine-batched.md, `loop_late`)."""
    woken, ready = rec.get("woken_ms"), rec.get("ready_ms")
    return round(woken - ready, 1) if isinstance(woken, (int, float)) and isinstance(ready, (int, float)) else None


def _ready(r: dict[str, Any]) -> float:
    """When the successor was ready: no token of it can come before (the kill's time where its health does not
    say)."""
    rec = r["successor"].get("recovery") or {}
    t0, ready = rec.get("t0_wall"), rec.get("ready_ms")
    return t0 + ready / 1000 if isinstance(t0, (int, float)) and isinstance(ready, (int, float)) else r["t_kill"]


def token_phases(streams: list[Stream]) -> dict[str, Any]:
    """Where the streams' first-token time went: each engine phase (engines/batched/http_state.py `PHASES`, as
    its closing line gives them), and around them, from the router's marks (services/router/relay.py
    `router_ms`): `router_to_send` (its relay to its request to the engine: a hold, the table's pick),
    `router_connected` (a connection opened on the way, where one was; `router_connect` the connect itself: ~0
    where a spare one was taken), `router_head` (to the response's head),
    `router_engine_links` (the request to the first line read back, less the engine's phases: the connection,
    the engine's HTTP server, the line's way back), `client_edges` (the rest: the client's request to the
    router's relay and the line on to the client), `client_to_router` (its first part)."""
    names = dict.fromkeys(name for s in streams for name in s.phases)  # in the engine's order
    out: dict[str, Any] = {name: pct([s.phases[name] for s in streams if name in s.phases]) for name in names}
    both = [(s, t) for s in streams if s.phases and {"sent", "first_line"} <= s.router.keys()
            and (t := s.first_token_ms()) is not None]
    out["router_to_send"] = pct([s.router["sent"] for s, _ in both])
    out["router_connected"] = pct([s.router["connected"] - s.router["sent"] for s, _ in both if "connected" in s.router])
    out["router_connect"] = pct([s.router["connected"] - s.router["connect"] for s, _ in both
                                 if {"connect", "connected"} <= s.router.keys()])  # ~0: a spare was taken
    out["router_head"] = pct([s.router["answered"] - s.router["sent"] for s, _ in both if "answered" in s.router])
    out["router_engine_links"] = pct([s.router["first_line"] - s.router["sent"] - sum(s.phases.values()) for s, _ in both])
    out["client_edges"] = pct([t - s.router["first_line"] for s, t in both])
    out["client_to_router"] = pct([(s.router_at - s.sent_at) * 1000 for s, _ in both if s.router_at])
    return out


def summarize(rounds: list[dict[str, Any]], control: dict[str, Any] | None, *,
              deterministic: bool = True) -> dict[str, Any]:
    """`mismatched` (outputs unlike the control's) only in deterministic mode (None otherwise: a fast mode's
    tokens depend on the batch); `lost` counts errors, streams with no end and ended ones with a token missing or
    repeated (`wrong_length`)."""
    streams = [s for r in rounds for s in r["streams"]]
    lates = [s for r in rounds for s in r["late"]]
    gaps = [g for s in streams if (g := s.largest_gap_ms()) is not None]
    ttft = [t for s in lates if (t := s.first_token_ms()) is not None]
    wrong_length = sum(1 for s in streams + lates if s.done and not s.error and s.want and len(s.tokens) != s.want)
    lost = sum(1 for s in streams + lates if s.error or not s.done) + wrong_length
    ref = {s.prompt: s.tokens for s in (control["streams"] + control["late"])} if control else {}
    mismatched = (sum(1 for s in streams + lates if s.done and ref.get(s.prompt) is not None
                      and s.tokens != ref[s.prompt]) if deterministic else None)
    # per stream of a failover round: its first token from the successor (after it was ready: the predecessor's
    # last tokens may still arrive after the kill), in ms after the kill
    resumed = [(t - r["t_kill"]) * 1000 for r in rounds if "successor" in r for s in r["streams"]
               if (t := min((a for a in s.arrivals if a > _ready(r)), default=None)) is not None]
    out: dict[str, Any] = {"largest_gap_ms": pct(gaps), "late_first_token_ms": pct(ttft),
                           "late_first_token_phases_ms": token_phases(lates),
                           "stream_resumed_after_kill_ms": pct(resumed),
                           "stream_first_token_ms": pct([t for s in streams if (t := s.first_token_ms()) is not None]),
                           "lost": lost, "wrong_length": wrong_length, "mismatched": mismatched,
                           "requests": len(streams) + len(lates),
                           "client": client_report(rounds),
                           "router_spare_connections": [r.get("router_spares") for r in rounds],
                           "router_cpu_us_a_line": [r.get("router_cpu_us_a_line") for r in rounds]}
    succ = [r["successor"] for r in rounds if "successor" in r]
    if succ:
        eng = [h.get("engine") or {} for h in succ]
        out["standby_gpu_mib"] = [r.get("standby_gpu_mib") for r in rounds]
        out["successor"] = {
            "recomputed_prefill_tokens": sum(e.get("recomputed_tokens", 0) + e.get("claim_extra_tokens", 0) for e in eng),
            # apart: the prompts it prefilled again (requests it did not hold), and the tokens it was fed again from
            # the router's replay past what it held (a KV backup's lag: made after its last round)
            "recomputed_tokens": sum(e.get("recomputed_tokens", 0) for e in eng),
            "claim_extra_tokens": sum(e.get("claim_extra_tokens", 0) for e in eng),
            "adopted": [e.get("adopted") for e in eng], "claimed": [e.get("claimed") for e in eng],
            "graphs_captured_ms": [e.get("graphs_captured_ms") for e in eng],
            "held_back_ms": [e.get("held_back_ms") for e in eng],  # isolation.py: slots and blocks given back
            "recovery": [h.get("recovery") for h in succ],
            "t_kill": [r["t_kill"] for r in rounds if "successor" in r],  # wall time: to read beside outside samples
            # --kill-successor: the first successor killed once it served (engine id, pid, wall time, and how many
            # streams were still open then); `successor` is then the second incident's
            "second_kill": [r.get("second_kill") for r in rounds if "successor" in r],
            # per kill, how long after the successor was ready the requests held for it went on (None: none held)
            "held_released_after_ready_ms": [released_after_ready(h.get("recovery") or {}) for h in succ],
            # where its time went: the slowest steps with their make-up, and its first tokens' phases
            "step_times": [e.get("step_times") for e in eng],
            "first_token_phases_ms": [h.get("first_token_phases_ms") for h in succ],
            # what it prepared as a standby: reservations, graphs, its rehearsal of a takeover (or why it failed)
            "prepared": [h.get("prepared") for h in succ]}
        out["router_loop_late"] = [r.get("router_loop_late") for r in rounds]
        out["detected_as"] = [r.get("detected_as") for r in rounds if "timeline_ms" in r]  # the fault's detail
        out["timeline_ms"] = [dict(sorted(((k, round(v, 1)) for k, v in r["timeline_ms"].items() if v is not None),
                                          key=lambda kv: kv[1]))
                              for r in rounds if "timeline_ms" in r]
    return out


# a spare on the other GPU takes the host backup over; a cold engine there does; none kept: a cold start and the
# router's replay
GPU_FAULT_WAYS = ("spare", "backup", "replay")
# a group's (`tp` > 1, on 2 x tp GPUs): a spare group takes every rank's backup over; none, the default policy: a
# whole group fits on the other GPUs, so a cold group starts there and the router replays every stream
GROUP_FAULT_WAYS = ("spare", "cold")


async def run_gpu_fault(*, backend: str, size: str, streams: int, late: int, trials: int, max_tokens: int,
                        kv_cache_gib: float | None, work_dir: Path | None, step_tokens: int = 2048,
                        prefill_chunk: int = 256, client_procs: int = 0, deterministic: bool = True,
                        ways: tuple[str, ...] | None = None, tp: int = 1,
                        kill_successor: bool = False) -> dict[str, Any]:
    """`--gpu-fault`: the active engine's GPU fails under the load (its weights and cache lost with it) on a node of
    two GPUs, no standby, each way on a stack of its own, side by side in one run: `spare` (the engine keeps its KV
    in host memory and its spec a spare on the other GPU, its weights loaded: the spare continues every sequence from
    the backup, docs/multi_gpu.md "Spares"), `backup` (the same backup, no spare: a cold engine on the other GPU
    continues from it, docs/kv_backup.md) and `replay` (no backup: a cold start there, every stream replayed by the
    router and its prompt prefilled again). Each with its no-failure control; a trial fails the GPU the engine is on,
    the other one marked healthy first (and, `spare`, a spare standing by on it: `gpus_replaced`); with the backup,
    once a backup round vouches for every stream (`gpu_fault`: what a sequence younger than the lag costs is a
    replay's). `tp` > 1: a group of `tp` ranks on a node of 2 x `tp` GPUs, its last rank's GPU failed, the ways
    `GROUP_FAULT_WAYS`: `spare` (a spare group on the other GPUs takes every rank's backup over) and `cold` (the same
    backups, no spare: by the default policy a whole cold group on the other GPUs, every stream replayed).
    `kill_successor`: a second failure in the `spare` way: the spare SIGKILLed as soon as it serves, the backup it
    took over and the streams it continues in flight (the other ways have no standby to kill)."""
    ways = ways or (GPU_FAULT_WAYS if tp == 1 else GROUP_FAULT_WAYS)
    if backend != "host":
        raise ValueError("--gpu-fault marks a simulated GPU failed: the host backend (a node of two real GPUs would "
                         "lose a real one's memory; not built for the cuda backend)")
    report: dict[str, Any] = {"bench": "recovery-gpu-fault", "backend": backend, "size": size, "streams": streams,
                              "late": late, "trials": trials, "max_tokens": max_tokens, "deterministic": deterministic,
                              "tp": tp, "kill_successor": kill_successor, "ways": {}}
    base = work_dir or Path(tempfile.mkdtemp(prefix="holdfast-gpu-fault-"))
    weights = base / f"weights-{size}.safetensors"  # one file for every way; each way's stack and state its own
    try:
        for way in ways:
            (base / way).mkdir(parents=True, exist_ok=True)
            sc = LoadScenario(size=size, backend=backend, standbys=0, max_num_seqs=max(256, streams + late),
                              kv_cache_gib=kv_cache_gib, work_dir=base / way, weights=weights, step_tokens=step_tokens,
                              prefill_chunk=prefill_chunk, shadow=False, deterministic=deterministic, gpus=2 * tp,
                              kv_backup=way in ("spare", "backup", "cold"), spares=int(way == "spare"), tp=tp)
            fault = functools.partial(gpu_fault, backed_rows=streams if sc.kv_backup else 0)
            report["ways"][way] = await _rounds(sc, streams, late, trials, max_tokens, client_procs, deterministic,
                                                fault=fault, prepare=functools.partial(gpus_replaced, spares=sc.spares),
                                                kill_successor=kill_successor and way == "spare")
        if work_dir is None:  # every way ran: nothing of this run is kept (its logs are, when one did not)
            shutil.rmtree(base, ignore_errors=True)
    finally:
        if work_dir is None:
            weights.unlink(missing_ok=True)
    return report


async def _rounds(sc: LoadScenario, streams: int, late: int, trials: int, max_tokens: int, client_procs: int,
                  deterministic: bool, *, fault: Fault | None = None, kill_successor: bool = False,
                  prepare: Prepare | None = None) -> dict[str, Any]:
    """The stack up, a no-failure control round, then `trials` rounds with a failure each; the stack down."""
    measured = False  # every round ran: the scenario's own files can go (its logs are kept otherwise)
    await asyncio.to_thread(sc.start)
    assert sc.stack is not None
    pool = ClientPool(sc.stack.router_url, MODEL, client_procs or default_client_procs(),
                      api_key=sc.stack.router_key())
    try:
        await sc.connect()
        async with httpx.AsyncClient() as client:  # the bench's own calls (router stats, health), not the streams
            warm = 4
            control = await one_round(sc, client, pool, streams, late, max_tokens, kill=False, warm_tokens=warm)
            rounds = [await one_round(sc, client, pool, streams, late, max_tokens, kill=True, warm_tokens=warm,
                                      kill_successor=kill_successor, fault=fault, prepare=prepare)
                      for _ in range(trials)]
        measured = True
        return {"no_failure": summarize([control], control, deterministic=deterministic),
                "failure": summarize(rounds, control, deterministic=deterministic)}
    finally:
        pool.close()
        await sc.close()
        sc.stop()
        sc.finish(ok=measured)


async def run(*, backend: str, size: str, streams: int, late: int, trials: int, max_tokens: int,
              kv_cache_gib: float | None, work_dir: Path | None, step_tokens: int = 2048,
              prefill_chunk: int = 256, client_procs: int = 0, fenced: bool = True,
              shadow: bool = True, isolated: bool = True, deterministic: bool = True,
              kill_successor: bool = False, router_hold_s: float | None = None,
              drawn: bool = False, secure: bool = True) -> dict[str, Any]:
    # `router_hold_s`: the router's own hold for a model with no endpoint (None: its default). A recovery's
    # successor is waited for beyond it (router table.py, invariant 2), a cold one after a second failure included.
    # `work_dir` keeps the weights file for the next run; each run's stack (its etcd, lease table, credentials) is
    # a fresh one of its own, so that no run starts from another's state
    weights = work_dir / f"weights-{size}{'.drawn' if drawn else ''}.safetensors" if work_dir is not None else None
    sc = LoadScenario(size=size, backend=backend, standbys=1, max_num_seqs=max(256, streams + late),
                      kv_cache_gib=kv_cache_gib, weights=weights, step_tokens=step_tokens,
                      prefill_chunk=prefill_chunk, fenced=fenced, shadow=None if shadow else False, isolated=isolated,
                      deterministic=deterministic, router_hold_s=router_hold_s, drawn=drawn, secure=secure)
    got = await _rounds(sc, streams, late, trials, max_tokens, client_procs, deterministic,
                        kill_successor=kill_successor)
    return {"bench": "recovery-load", "backend": backend, "size": size, "streams": streams, "late": late,
            "trials": trials, "max_tokens": max_tokens, "step_tokens": step_tokens, "prefill_chunk": prefill_chunk,
            "fenced": fenced, "shadow": sc.shadow, "isolated": isolated, "deterministic": deterministic,
            "kill_successor": kill_successor, "weights_drawn": drawn, "secure": secure, "machine": describe(),
            "no_failure": got["no_failure"], "sigkill": got["failure"]}
