"""The failure/recovery scenario that `holdfast demo`, `holdfast bench recovery` and the end-to-end test share.

A `Scenario` runs the real stack (nats, etcd, gpu_manager with its keeper, agent with one reference
engine and one warm standby, dc_manager, controller, router), then measures from the client's side:
requests streamed through the router, an engine SIGKILLed mid-generation, the events of the incident
as they are published, and the first token served after the death.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from devstack.pagecache import drop_cache
from devstack.stack import Stack, StackConfig
from libs.common.bus import Bus
from libs.common.events import EngineInfo, EngineSpec, Envelope, ListLeases, ListLeasesReply
from libs.common.store import Store

MODEL = "demo"
PROMPTS = ["Holdfast keeps the weights", "A crash should cost milliseconds,", "The standby takes over and"]
TIMELINE_EVENTS = {
    "fault.detected": "detected",
    "incident.opened": "incident opened",
    "intent.recover": "intent sent",
    "memory.frozen": "frozen",
    "router.endpoint.removed": "endpoint removed",
    "engine.reattached": "taken over",
    "router.endpoint.added": "endpoint added",
    "incident.resolved": "incident resolved",
    "incident.failed": "incident FAILED",
}


def detect_backend() -> str:
    from libs.common.gpu import has_gpu

    return "cuda" if has_gpu() else "host"


def make_weights(size: str, out: Path, *, drawn: bool = False) -> Path:
    """The seeded weights file of `size` at `out` unless one is there; `drawn`: the header alone, its values drawn
    by each load on its own device (engines/reference/weights.py)."""
    if not out.exists():
        r = subprocess.run([sys.executable, "-m", "engines.reference", "make-weights", "--size", size, "--out",
                            str(out), *(["--drawn"] if drawn else [])], capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"make-weights --size {size} exited {r.returncode}: {r.stderr[-3000:]}")
    return out


def engine_command(weights: Path, size: str, max_seq: int | None = None) -> list[str]:
    argv = [sys.executable, "-m", "engines.reference", "serve", "--weights", str(weights), "--size", size]
    return argv + (["--max-seq", str(max_seq)] if max_seq else [])


def in_memory_fs(path: Path) -> bool:
    """The file lives on tmpfs/ramfs: dropping the page cache cannot take it out of memory."""
    best, fstype = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and str(path.resolve()).startswith(parts[1].rstrip("/") + "/") and len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return fstype in ("tmpfs", "ramfs")


def successor_marks(recovery: dict[str, Any], t_kill: float) -> dict[str, float]:
    """The successor's own moments on the timeline (ms after the death): its assignment (or a fresh process's
    start) and its first request's arrival in its HTTP handler, placed by the wall time of its clock's origin
    (`t0_wall`, same host), so that the steps between the control plane's events and its first token show."""
    t0 = recovery.get("t0_wall")
    if not isinstance(t0, (int, float)):
        return {}
    assigned = (t0 - t_kill) * 1000.0
    out = {"successor assigned": assigned}
    handler = (recovery.get("first_generation") or {}).get("handler")
    if isinstance(handler, (int, float)):
        out["successor first request"] = assigned + handler
    return out


ROUTE_IN_MARKS = {"promised": "router promised", "received": "router received", "first_sent": "router first request",
                  "first_answered": "router first answer"}


def router_marks(route_ins: list[dict[str, Any]], engine_id: str, t_kill: float) -> dict[str, float]:
    """The router's moments of the successor's route-in (services/router/route_ins.py) on the timeline (ms
    after the death): between `endpoint added` and the successor's handler, where no event shows."""
    entry = next((e for e in reversed(route_ins) if e.get("engine_id") == engine_id), None)
    if entry is None:
        return {}
    return {label: (entry[key] - t_kill) * 1000.0 for key, label in ROUTE_IN_MARKS.items()
            if isinstance(entry.get(key), (int, float))}


@dataclass
class Trial:
    """One SIGKILL of the serving engine and what the clients saw of its recovery."""

    t_kill: float
    first_token: float | None
    results: list[StreamResult]
    timeline_ms: dict[str, float]
    lost: int
    mismatched: int
    incident_id: str | None
    weights_before: str | None = None
    weights_after: str | None = None
    engine_recovery: dict[str, Any] = field(default_factory=dict)  # the successor's own /health "recovery"

    @property
    def recovery_ms(self) -> float | None:
        return (self.first_token - self.t_kill) * 1000.0 if self.first_token else None

    def steps_ms(self) -> dict[str, float]:
        """The split by step. The agent's `taken over` and the controller's `endpoint added` both follow the
        takeover reply and race each other, so reroute is the announcement's lag behind the takeover
        (0 when it came first) and first_token counts from whichever came last. A shadow may be promoted
        while the freeze runs (dc_manager): its reattach is then 0 and reroute counts from the freeze."""
        t = self.timeline_ms
        out: dict[str, float] = {}
        detected, frozen = t.get("detected"), t.get("frozen")
        taken, added, first = t.get("taken over"), t.get("endpoint added"), t.get("first token after recovery")
        if detected is not None:
            out["detect"] = detected
            if frozen is not None:
                out["freeze"] = frozen - detected
                if taken is not None:
                    out["reattach"] = max(0.0, taken - frozen)
        if taken is not None and added is not None:
            out["reroute"] = max(0.0, added - max(taken, frozen if frozen is not None else taken))
        ready = max((v for v in (taken, added) if v is not None), default=None)
        if first is not None and ready is not None:
            out["first_token"] = first - ready
        return out


@dataclass
class StreamResult:
    prompt: str
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # epoch seconds of each token
    error: str | None = None
    done: bool = False

R = TypeVar("R", bound=StreamResult)


def dump_stacks(pid: int) -> None:
    """Every thread's stack of an engine and of its children (a group's ranks) in their logs (faulthandler on
    SIGUSR2): what a test that timed out waiting on it leaves to read."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    for p in (pid, *children):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGUSR2)


async def read_generation(client: httpx.AsyncClient, router_url: str, result: R, *, model: str, max_tokens: int,
                          timeout: float, on_token: Callable[[], None] | None = None,
                          headers: dict[str, str] | None = None) -> R:
    """Stream `result.prompt` through the router's `/v1/generate` (greedy, EOS ignored: outputs comparable run to
    run) and read its NDJSON lines into `result`: each token with its arrival time, then the closing line's
    verdict. Never raises: an HTTP error, a stream that breaks or ends without its closing line is `result.error`
    or `done` false, a finding the caller counts as a lost request. `on_token` runs once per token received."""
    body = {"model": model, "prompt": result.prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    try:
        async with client.stream("POST", f"{router_url}/v1/generate", json=body, timeout=timeout,
                                 headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                obj = json.loads(line)
                if obj.get("done"):
                    result.text += obj.get("text", "")  # an unfinished last character's text
                    result.done = not obj.get("error")
                    if obj.get("error"):
                        result.error = json.dumps(obj["error"])
                    break
                result.tokens.append(int(obj["token"]))
                result.text += obj.get("text", "")
                result.arrivals.append(time.time())
                if on_token:
                    on_token()
    except Exception as e:  # noqa: BLE001 - a lost request is a finding, reported by the caller
        result.error = f"{type(e).__name__}: {e}"
    return result


class Scenario:
    def __init__(self, *, size: str, backend: str, standbys: int = 1, max_tokens: int = 48,
                 work_dir: Path | None = None, shadow: bool = True, weights: Path | None = None,
                 max_seq: int | None = None, models: int = 1, secure: bool = True) -> None:
        self.size = size
        self.secure = secure  # auth and TLS on NATS and etcd (False: what they cost, `bench recovery --no-secure`)
        # the models served, each from one spec (same weights): `demo`, then `demo-2`...; a chaos run's faults on
        # engines of different models overlap
        self.models = [MODEL] + [f"{MODEL}-{i}" for i in range(2, models + 1)]
        self.max_seq = max_seq  # KV capacity per slot of every engine (a large model's caches must fit beside it)
        self.shadow = shadow  # standbys shadow the active engine's weights (engines/reference/standby.py)
        self.backend = backend
        self.max_tokens = max_tokens
        self.own_dir = work_dir is None  # made here: `finish` removes it after a run that went well
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix="holdfast-demo-"))
        self.weights = weights or self.work_dir / f"weights-{size}.safetensors"  # shared by a benchmark's ways
        self.standbys = standbys
        self.stack: Stack | None = None
        self.bus: Bus | None = None
        self.store: Store | None = None
        self.events: list[tuple[float, Envelope]] = []
        self.tokens_streamed = 0  # every token any client stream received (to time a kill mid-generation)
        self._event_waiters: list[tuple[str, asyncio.Future[Envelope]]] = []

    # ------------------------------------------------------------ stack

    def start(self) -> Stack:
        make_weights(self.size, self.weights)
        spec = EngineSpec(engine_class="reference", model=MODEL, command=engine_command(self.weights, self.size, self.max_seq),
                          replicas=1, standbys=self.standbys, cold_start_s=30.0,
                          env={"HF_ENGINE_SHADOW": "true" if self.shadow else "false"})
        specs_file = self.write_specs(spec)
        self.stack = Stack(StackConfig.ephemeral(base_dir=self.work_dir / "stack", backend=self.backend,
                                                 engines_file=specs_file, secure=self.secure))
        self.stack.start(timeout=120)
        return self.stack

    def write_specs(self, spec: EngineSpec) -> Path:
        """The engines file: `spec` once per model of this scenario."""
        specs_file = self.work_dir / "engines.json"
        specs_file.write_text(json.dumps([spec.model_copy(update={"model": m}).model_dump(mode="json")
                                          for m in self.models]))
        return specs_file

    async def connect(self) -> None:
        assert self.stack is not None
        self.bus = await Bus.connect(self.stack.settings(), "demo", stream=False)
        self.store = await Store.connect(self.stack.settings())
        for subject in TIMELINE_EVENTS:
            await self.bus.subscribe(subject, self._on_event)

    async def _on_event(self, env: Envelope) -> None:
        # When the event happened is when its publisher built it (same host, same clock), not when this process
        # got round to it: each subscription's messages are handled by a task of its own, and with the client's
        # streams on the same loop, one of them may run 10+ ms late (fault.detected was once seen after
        # memory.frozen, which the fault caused).
        self.events.append((env.time, env))
        for subject, fut in list(self._event_waiters):
            if subject == env.type and not fut.done():
                fut.set_result(env)

    async def wait_event(self, subject: str, timeout: float, *, after: int = 0) -> Envelope:
        for _, env in self.events[after:]:
            if env.type == subject:
                return env
        fut: asyncio.Future[Envelope] = asyncio.get_running_loop().create_future()
        self._event_waiters.append((subject, fut))
        return await asyncio.wait_for(fut, timeout)

    async def close(self) -> None:
        if self.bus:
            await self.bus.close()
        if self.store:
            await self.store.close()

    def stop(self) -> None:
        if self.stack:
            self.stack.stop()

    def discard_weights(self) -> None:
        """Remove the weights file this scenario made in its own work dir (GBs on a GPU); logs stay."""
        if self.weights.parent == self.work_dir:
            self.weights.unlink(missing_ok=True)

    def finish(self, ok: bool) -> Path | None:
        """After `stop`: the weights it made go; a work dir of its own goes too when the run went well (its etcd's
        data alone is ~60 MB), and is kept for its logs when it did not: that path is returned (None: nothing kept)."""
        self.discard_weights()
        if self.own_dir and ok:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            return None
        return self.work_dir

    # ------------------------------------------------------------ engines

    async def engines(self) -> list[EngineInfo]:
        assert self.store is not None
        raw = await self.store.get_prefix("engines/")
        return [EngineInfo.model_validate_json(v) for v in raw.values()]

    async def wait_serving(self, *, standbys: int | None = None, timeout: float = 180.0,
                           model: str = MODEL) -> EngineInfo:
        """Until one active engine of `model` is ready and routed, and the wanted number of its standbys wait
        (shadowing it, when standbys shadow)."""
        want = self.standbys if standbys is None else standbys
        deadline = time.monotonic() + timeout
        while True:
            engines = [e for e in await self.engines() if e.model == model]
            active = [e for e in engines if e.role == "active" and e.state == "ready"]
            ready_standbys = [e for e in engines if e.role == "standby" and e.state in ("standby", "ready")
                              and (not self.shadow or any(e.shadows == a.engine_id for a in active))]
            routed = await self.store.get_prefix(f"endpoints/{model}/") if self.store else {}
            if active and len(ready_standbys) >= want and routed:
                return active[0]
            if time.monotonic() > deadline:
                states = [(e.engine_id, e.role, e.state, e.shadows) for e in engines]
                raise TimeoutError(f"engines not serving after {timeout}s: {states}")
            await asyncio.sleep(0.1)

    async def leases(self) -> ListLeasesReply:
        assert self.bus is not None and self.stack is not None
        return await self.bus.request(self.stack.config.node, ListLeases(), ListLeasesReply, timeout=5)

    # ------------------------------------------------------------ traffic

    async def generate(self, client: httpx.AsyncClient, prompt: str, *, stream: bool = True,
                       max_tokens: int | None = None, model: str = MODEL) -> StreamResult:
        assert self.stack is not None

        def counted() -> None:
            self.tokens_streamed += 1

        return await read_generation(client, self.stack.router_url, StreamResult(prompt), model=model,
                                     max_tokens=max_tokens or self.max_tokens, timeout=120, on_token=counted,
                                     headers=self.stack.router_headers())

    async def router_stats(self, client: httpx.AsyncClient) -> dict[str, Any]:
        assert self.stack is not None
        r = await client.get(f"{self.stack.router_url}/stats", timeout=10, headers=self.stack.router_headers())
        r.raise_for_status()
        return dict(r.json())

    async def engine_health(self, endpoint: str) -> dict[str, Any]:
        async with httpx.AsyncClient() as c:
            r = await c.get(f"{endpoint}/health", timeout=10)
            return dict(r.json())

    async def until_backed_up(self, endpoint: str, rows: int, timeout: float = 60, pid: int | None = None,
                              streams: Sequence[asyncio.Task[Any]] = ()) -> dict[str, Any]:
        """Wait until the engine's KV backup (`--kv-backup`) vouches for `rows` sequences (a done round covers
        them): a loss from here has something to restore, however slowly a loaded machine runs the rounds. On a
        timeout, `pid` (the engine's, and its ranks') is asked for every thread's stack in its log (SIGUSR2).
        `streams`: the generations those sequences are; one that ends first is said at once, with the backup's
        stats (`rows_max`: the most it vouched for at once, so whether it ever covered them all)."""
        deadline = time.monotonic() + timeout
        while True:
            backup = (await self.engine_health(endpoint)).get("kv_backup") or {}
            if backup.get("error"):
                raise RuntimeError(f"the engine's KV backup failed: {backup['error']}")
            if backup.get("rows", 0) >= rows and backup.get("durable_tokens", 0) > 0:
                return dict(backup)
            if any(t.done() for t in streams):
                raise RuntimeError(f"a stream ended before the KV backup vouched for {rows} at once; raise max_tokens "
                                   f"(its stats: {backup})")
            if time.monotonic() > deadline:
                if pid is not None:
                    dump_stacks(pid)
                raise TimeoutError(f"the KV backup vouched for {backup.get('rows')} of {rows} sequences in {timeout} s "
                                   f"(its stats: {backup})")
            await asyncio.sleep(0.02)

    async def weights_checksum(self, endpoint: str) -> str | None:
        async with httpx.AsyncClient() as c:
            r = await c.get(f"{endpoint}/checksum", timeout=600)
            return r.json().get("weights_sha256") if r.status_code == 200 else None

    def kill_engine(self, info: EngineInfo) -> float:
        assert info.pid is not None
        t = time.time()
        os.kill(info.pid, signal.SIGKILL)
        return t

    # ------------------------------------------------------------ one failover, measured

    async def baseline(self, client: httpx.AsyncClient, model: str = MODEL) -> dict[str, StreamResult]:
        out = {p: (await self.generate(client, p, model=model)) for p in PROMPTS}
        for r in out.values():
            if r.error or not r.done:
                raise RuntimeError(f"baseline request failed: {r.error}")
        return out

    async def failover_trial(self, client: httpx.AsyncClient, baseline: dict[str, StreamResult], *,
                             check_weights: bool = True) -> Trial:
        """Stream requests, SIGKILL the serving engine mid-generation, send more during the outage, wait
        for the incident to resolve; compare every output with the uninterrupted run."""
        active = await self.wait_serving()
        assert active.endpoint
        before = await self.weights_checksum(active.endpoint) if check_weights else None
        seen = len(self.events)
        streams = [asyncio.create_task(self.generate(client, p)) for p in PROMPTS]
        await self._until_tokens(streams, want=4)
        t_kill = self.kill_engine(active)
        late = [asyncio.create_task(self.generate(client, p)) for p in PROMPTS[:2]]  # sent during the outage
        results = list(await asyncio.gather(*streams, *late))
        resolved = await self.wait_event("incident.resolved", 60, after=seen)
        lost = sum(1 for r in results if r.error or not r.done)
        mismatched = sum(1 for r in results if not r.error and r.tokens != baseline[r.prompt].tokens)
        # Tokens the predecessor wrote just before its death can still arrive after t_kill; the successor's
        # first token cannot come before the endpoint is announced (the router replays and releases held
        # requests on that event), so count from the announcement.
        announced = [at for at, env in self.events[seen:] if env.type == "router.endpoint.added" and at >= t_kill]
        since = min(announced) if announced else t_kill
        after = [t for r in results for t in r.arrivals if t > since]
        first_token = min(after) if after else None
        successor = await self.wait_serving(standbys=0, timeout=60)
        after_sum = await self.weights_checksum(successor.endpoint or "") if check_weights else None
        health = await self.engine_health(successor.endpoint or "")
        recovery = dict(health.get("recovery") or {})
        for key in ("kv_reused", "continued"):  # prefixes copied from the predecessor's cache; generations resumed
            if health.get(key):
                recovery[key] = health[key]
        route_ins = (await self.router_stats(client)).get("route_ins") or []
        timeline = {**self.timeline(t_kill, first_token, after=seen)[0], **successor_marks(recovery, t_kill),
                    **router_marks(route_ins, successor.engine_id, t_kill)}
        return Trial(t_kill, first_token, results, dict(sorted(timeline.items(), key=lambda kv: kv[1])), lost,
                     mismatched, resolved.incident_id, before, after_sum, recovery)

    async def _until_tokens(self, tasks: list[asyncio.Task[Any]], want: int) -> None:
        """Wait until `want` more tokens streamed, so the kill lands mid-generation."""
        start = self.tokens_streamed
        deadline = time.monotonic() + 60
        while self.tokens_streamed - start < want:
            if any(t.done() for t in tasks):
                raise RuntimeError("a stream ended before the kill; raise max_tokens")
            if time.monotonic() > deadline:
                raise TimeoutError("no tokens streamed within 60 s")
            await asyncio.sleep(0.002)

    def timeline(self, t_kill: float, first_token: float | None, *,
                 after: int = 0) -> tuple[dict[str, float], str | None]:
        """Each control-plane step's first event after the kill (ms after it), in order; and the detail of the first
        fault detected: which way the agent saw the death (its poll, a death mark, the pidfd...)."""
        out: dict[str, float] = {"death": 0.0}
        detected_as: str | None = None
        for at, env in self.events[after:]:
            label = TIMELINE_EVENTS.get(env.type)
            if label and at >= t_kill and label not in out:
                out[label] = (at - t_kill) * 1000.0
                if env.type == "fault.detected":
                    detected_as = getattr(env.data, "detail", None)
        if first_token:
            out["first token after recovery"] = (first_token - t_kill) * 1000.0
        return dict(sorted(out.items(), key=lambda kv: kv[1])), detected_as

    # ------------------------------------------------------------ cold restart, for comparison

    def cold_restart(self, *, drop_caches: bool = True) -> dict[str, Any]:
        """A new engine process loading the weights from the file (plain tensors, no Holdfast), timed from
        its spawn to its first token; the weights file's pages are dropped from the page cache first (that file's
        only: the machine's cache is not ours to empty, and a restart on the same node finds its libraries cached)."""
        dropped = False
        if drop_caches:
            with contextlib.suppress(OSError):
                drop_cache([self.weights])
                dropped = True
        ready = self.work_dir / f"cold-ready-{time.time_ns()}.json"
        argv = [*engine_command(self.weights, self.size, self.max_seq), "--id", f"cold-{os.getpid()}", "--memory", "local",
                "--agent", "off", "--ready-file", str(ready)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        t0 = time.time()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            while not ready.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"cold engine exited {proc.returncode}: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
                if time.time() - t0 > 1800:
                    raise TimeoutError("cold engine not ready after 30 minutes")
                time.sleep(0.005)
            endpoint = json.loads(ready.read_text())["endpoint"]
            with httpx.Client() as c, c.stream("POST", f"{endpoint}/generate", timeout=120,
                                                  json={"prompt": PROMPTS[0], "max_tokens": 1, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.strip():
                        break
            first_token = time.time()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        in_memory = in_memory_fs(self.weights)  # tmpfs: "dropped" would be false comfort
        return {"cold_restart_ms": (first_token - t0) * 1000.0, "page_cache_dropped": dropped and not in_memory,
                "weights_in_memory_fs": in_memory}
