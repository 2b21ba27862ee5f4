"""`holdfast bench sleep --weights-gib N --kv-cache-gib M --level 1|2|1,2 --trials T [--json]`: an engine put to
sleep and woken again (issue 21), measured.

A real gpu_manager (nats, etcd and the gpu_manager of `devstack.stack`, no agent or control plane: the node command
is sent directly, as the controller would) and a real batched engine process (leased memory, deterministic mode,
its weights about N GiB, its KV cache M GiB). Each trial sends `SleepEngine(level)` then `SleepEngine(wake)` and
reports:
- the command's time from the ask to the engine's answer (it includes waiting for the engine's next heartbeat),
  and the engine's own sleep and wake time (quiesce to asleep; wake call to serving);
- free memory before the sleep, while asleep and after the wake: on cuda the device's, measured here by NVML (or
  cuMemGetInfo where nvidia-ml-py is missing: `meter` says which); on the host backend the gpu_manager's
  accounting (its capacity less the bytes of its resident leases, from its /metrics); beside it `held_bytes`, the
  memory the stack's processes really hold in lease memfds (their allocated pages, each memfd counted once);
- the bytes the manager released, and those the meter saw go;
- whether the greedy outputs of a few fixed prompts after the wake equal those before the first sleep.
Per level: p50 / p99 / max over trials of the times and bytes, and whether every trial's outputs were identical.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import typer

from bench.restore import reporter, stepper
from bench.stats import pct
from devstack.scenario import detect_backend, make_weights
from devstack.stack import Stack, StackConfig
from libs.common import procs
from libs.common.bus import Bus
from libs.common.events import SleepEngine, SleepEngineReply

GIB = 1024**3
ENGINE_ID = "sleep-bench"
PROMPTS = ["The engine sleeps and", "Its cache goes back to the device", "After the wake the tokens"]
LIVE_STATES = ("ACTIVE", "ORPHANED", "FROZEN")


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Per level: p50/p99/max of each timed or counted figure, and identity over all its trials (pure)."""
    out: dict[str, Any] = {}
    for level in sorted({t["level"] for t in trials}):
        ts = [t for t in trials if t["level"] == level and "error" not in t]
        failed = sum(1 for t in trials if t["level"] == level and "error" in t)
        row: dict[str, Any] = {"trials": len(ts), "failed": failed,
                               "identical": bool(ts) and all(t["identical"] for t in ts)}
        for key in ("sleep_s", "wake_s", "engine_sleep_ms", "engine_wake_ms", "bytes_released", "measured_released"):
            row[key] = pct([float(t[key]) for t in ts if t.get(key) is not None], digits=4)
        out[str(level)] = row
    return out


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(x not in (1, 2) for x in levels):
        raise ValueError(f"{text!r}: give 1, 2 or 1,2")
    return levels


# ---------------------------------------------------------------- meters


class DeviceMeter:
    """GPU 0's free memory, by NVML where nvidia-ml-py is installed, else the driver's cuMemGetInfo."""

    def __init__(self) -> None:
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            self.kind, self._nvml = "nvml", pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except ImportError:
            from libs.client import cuda_driver as cd

            cd.init()
            cd.primary_context(0)
            self.kind, self._cd = "cuMemGetInfo", cd

    def sample(self) -> dict[str, int]:
        if self.kind == "nvml":
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            return {"free_bytes": int(info.free), "held_bytes": int(info.used)}
        self._cd.primary_context(0)
        free, total = self._cd.check(self._cd.cu.cuMemGetInfo())
        return {"free_bytes": int(free), "held_bytes": int(total) - int(free)}


def lease_memfd_bytes(pids: list[int]) -> int:
    """The pages of lease memfds (`hf-<lease>-<i>`; not the host tier's nor placeholders) that these processes hold
    open or mapped, each memfd counted once: memory really held, not the manager's word for it."""
    seen: dict[int, int] = {}
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            entries = list(fd_dir.iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                target = os.readlink(entry)
                if _is_lease_memfd(target):
                    st = os.stat(entry)
                    seen[st.st_ino] = st.st_blocks * 512
            except OSError:
                continue
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and _is_lease_memfd(parts[5]) and int(parts[4]) not in seen:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                seen[int(parts[4])] = hi - lo  # mapped only (no fd left anywhere): its mapped length
    return sum(seen.values())


def _is_lease_memfd(name: str) -> bool:
    return "/memfd:hf-" in name and "/memfd:hf-tier-" not in name and "/memfd:hf-placeholder" not in name


class HostMeter:
    """The gpu_manager's accounting (capacity less resident leases, from its /metrics) and the memfd pages held."""

    def __init__(self, metrics_url: str, state_dir: Path) -> None:
        self.kind, self.url, self.state_dir = "gpu_manager accounting + memfd pages", metrics_url, state_dir

    def sample(self) -> dict[str, int]:
        cap = leased = 0
        for line in httpx.get(self.url, timeout=10).text.splitlines():
            if line.startswith("holdfast_gpu_manager_capacity_bytes{"):
                cap += int(float(line.rsplit(" ", 1)[1]))
            elif line.startswith("holdfast_gpu_manager_leased_bytes{") and any(f'"{s}"' in line or f".{s}\"" in line
                                                                               for s in LIVE_STATES):
                leased += int(float(line.rsplit(" ", 1)[1]))
        pids = procs.pids_with_env("HF_STATE_DIR", str(self.state_dir))
        return {"free_bytes": cap - leased, "held_bytes": lease_memfd_bytes(pids)}


# ---------------------------------------------------------------- the run


class SleepBench:
    def __init__(self, backend: str, weights_gib: float, kv_cache_gib: float, work: Path, levels: list[int]) -> None:
        from bench.recovery import size_for

        self.backend, self.work = backend, work
        self.size = size_for(backend, weights_gib)
        self.weights = make_weights(self.size, work / f"weights-{self.size}.safetensors")
        self.metrics_port = procs.free_port()
        tier = int(self.weights.stat().st_size * 1.1) + GIB if 2 in levels else 0  # a level-2 copy fits
        # the stack in a temporary directory of its own (short: its unix sockets' paths have a length limit)
        self.stack = Stack(StackConfig.ephemeral(backend=backend, services=("gpu_manager",),
                                                 extra_env={"HF_METRICS_PORT": str(self.metrics_port),
                                                            "HF_HOST_TIER_BYTES": str(tier),
                                                            "HF_ARTIFACT_DIR": str(work / "artifacts")}))
        self.kv_cache_gib = kv_cache_gib
        self.engine: procs.Child | None = None
        self.url = ""

    def start(self, timeout: float = 600) -> None:
        self.stack.start(timeout=120)
        ready = self.work / "engine.ready.json"
        ready.unlink(missing_ok=True)
        state = self.stack.base_dir / "state"
        argv = [sys.executable, "-m", "engines.batched", "--weights", str(self.weights), "--size", self.size,
                "--id", ENGINE_ID, "--memory", "leased", "--agent", "off", "--deterministic",
                "--device", "cuda" if self.backend == "cuda" else "cpu", "--max-num-seqs", "16",
                "--kv-cache-gib", str(self.kv_cache_gib), "--ready-file", str(ready)]
        env = {**self.stack.env(), "HF_GPU_MANAGER_SOCKET": str(state / "gpu_manager.sock")}
        self.engine = procs.Child(ENGINE_ID, argv, env=env, log_path=self.stack.logs / "engine.log").start()
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if not self.engine.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"engine did not start: {self.stack.tail('engine', 40)}")
            time.sleep(0.1)
        self.url = json.loads(ready.read_text())["endpoint"]

    def meter(self) -> DeviceMeter | HostMeter:
        if self.backend == "cuda":
            return DeviceMeter()
        return HostMeter(f"http://127.0.0.1:{self.metrics_port}/metrics", self.stack.base_dir / "state")

    def outputs(self, max_tokens: int) -> list[list[int]]:
        out = []
        for p in PROMPTS:
            r = httpx.post(self.url + "/generate", json={"prompt": p, "max_tokens": max_tokens, "ignore_eos": True,
                                                         "temperature": 0.0}, timeout=120)
            r.raise_for_status()
            out.append(r.json()["tokens"])
        return out

    def sleep_info(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/health", timeout=10).json().get("sleep") or {})

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop(30)
        self.stack.stop()


async def trial(b: SleepBench, bus: Bus, meter: Any, level: int, reference: list[list[int]], max_tokens: int,
                timeout_s: float) -> dict[str, Any]:
    async def ask(cmd: SleepEngine) -> tuple[SleepEngineReply, float, dict[str, int], dict[str, Any]]:
        """The command, its time, then the meter and the engine's own account of it."""
        t0 = time.perf_counter()
        reply = await bus.request(b.stack.config.node, cmd, SleepEngineReply, timeout=timeout_s + 30)
        seconds = time.perf_counter() - t0
        return reply, seconds, meter.sample(), await asyncio.to_thread(b.sleep_info)

    before = meter.sample()
    slept, sleep_s, asleep, engine_sleep = await ask(SleepEngine(engine_id=ENGINE_ID, level=level, timeout_s=timeout_s))
    woke, wake_s, after, engine_wake = await ask(SleepEngine(engine_id=ENGINE_ID, wake=True, timeout_s=timeout_s))
    outputs = await asyncio.to_thread(b.outputs, max_tokens)
    return {"level": level, "sleep_s": round(sleep_s, 4), "wake_s": round(wake_s, 4),
            "engine_sleep_ms": engine_sleep.get("sleep_ms"), "engine_wake_ms": engine_wake.get("wake_ms"),
            "free_bytes": {"before": before["free_bytes"], "asleep": asleep["free_bytes"], "after": after["free_bytes"]},
            "held_bytes": {"before": before["held_bytes"], "asleep": asleep["held_bytes"], "after": after["held_bytes"]},
            "bytes_released": slept.bytes, "bytes_mapped_on_wake": woke.bytes,
            "measured_released": asleep["free_bytes"] - before["free_bytes"],
            "measured_held_released": before["held_bytes"] - asleep["held_bytes"],
            "manager_free_bytes": {"sleep": [slept.free_bytes_before, slept.free_bytes_after],
                                   "wake": [woke.free_bytes_before, woke.free_bytes_after]},
            "leases": len(slept.lease_ids), "weights_source": woke.weights_source,
            "identical": outputs == reference}


async def run_trials(b: SleepBench, out: dict[str, Any], levels: list[int], trials: int, max_tokens: int,
                     timeout_s: float, step: Callable[[str], None]) -> None:
    """The trials into `out` as they go; one that fails is a row with its `error` (the engine is then in an unknown
    state: the trials left are not run)."""
    bus = await Bus.connect(b.stack.settings(), "bench-sleep", stream=False)
    try:
        meter = await asyncio.to_thread(b.meter)
        out["meter"] = meter.kind
        reference = await asyncio.to_thread(b.outputs, max_tokens)
        for level in levels:
            for i in range(trials):
                try:
                    out["trials"].append(await trial(b, bus, meter, level, reference, max_tokens, timeout_s))
                except Exception as e:  # noqa: BLE001 - in the report
                    out["trials"].append({"level": level, "error": f"{type(e).__name__}: {e}"})
                    out["summary"] = summarize(out["trials"])
                    step(f"level {level} trial {i + 1} failed")
                    return
                out["summary"] = summarize(out["trials"])
                step(f"level {level} trial {i + 1}")
    finally:
        await bus.close()


def run(backend: str, weights_gib: float, kv_cache_gib: float, levels: list[int], trials: int, *,
        max_tokens: int = 16, work_dir: Path | None = None, timeout_s: float = 300.0,
        progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The report; `progress(report)` after every step (a run cut off still leaves its figures). A failure is in
    the report (`error`, `complete: false`; a trial's own in its row), never only in a traceback."""
    backend = detect_backend() if backend == "auto" else backend
    work = Path(tempfile.mkdtemp(prefix="hf-bench-sleep-", dir=work_dir))
    out: dict[str, Any] = {"bench": "sleep", "backend": backend, "levels": levels, "max_tokens": max_tokens,
                           "trials": [], "summary": {}, "steps": [], "complete": False}
    step = stepper(out, progress)
    b: SleepBench | None = None
    try:
        b = SleepBench(backend, weights_gib, kv_cache_gib, work, levels)
        out["size"], out["weights_file_gib"] = b.size, round(b.weights.stat().st_size / GIB, 3)
        step("weights file written")
        b.start()
        memory = httpx.get(b.url + "/health", timeout=10).json().get("memory") or {}
        out["kv_bytes"], out["weights_load"] = memory.get("kv_bytes"), memory.get("weights")
        step("engine serving")
        asyncio.run(run_trials(b, out, levels, trials, max_tokens, timeout_s, step))
        out["complete"] = len(out["trials"]) == len(levels) * trials and not any("error" in t for t in out["trials"])
    except Exception as e:  # noqa: BLE001 - in the report, printed either way
        out["error"] = f"{type(e).__name__}: {e}"
        if b is not None and b.engine is not None:
            out["engine_log_tail"] = b.stack.tail("engine", 20)
    finally:
        if b is not None:
            b.stop()
            b.weights.unlink(missing_ok=True)
        step("done")
    return out


def cli(backend: str = typer.Option("auto", help="host, cuda or auto"),
        weights_gib: float = typer.Option(0.0, help="weights size (0: the tiny model on the host, small on cuda)"),
        kv_cache_gib: float = typer.Option(1.0, help="the engine's KV cache in GiB"),
        level: str = typer.Option("1", help="1 (the KV cache), 2 (its weights too), or 1,2 (both, in turn)"),
        trials: int = typer.Option(3, min=1, help="sleep/wake trials per level"),
        max_tokens: int = typer.Option(16, min=1, help="tokens of each greedy output compared"),
        dir: Path | None = typer.Option(None, help="where the weights file and the stack go"),
        out_path: Path | None = typer.Option(None, "--out", help="the JSON report, rewritten after every step"),
        json_out: bool = typer.Option(False, "--json")) -> None:
    """Sleep then wake of a batched engine: memory freed, sleep and wake time, outputs identical after the wake."""
    try:
        levels = parse_levels(level)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--level") from None

    result = run(backend, weights_gib, kv_cache_gib, levels, trials, max_tokens=max_tokens, work_dir=dir,
                 progress=reporter("bench sleep", out_path))
    if json_out:
        print(json.dumps(result, indent=2))
    else:
        show(result)
    if not result["complete"]:
        raise typer.Exit(1)


def show(result: dict[str, Any]) -> None:
    if "error" in result:
        print(f"sleep/wake FAILED: {result['error']}")
    print(f"sleep/wake on {result['backend']}, model {result.get('size')} ({result.get('weights_file_gib')} GiB "
          f"file), KV {result.get('kv_bytes')} bytes, meter {result.get('meter')}")
    for t in result["trials"]:
        if "error" in t:
            print(f"  level {t['level']}: FAILED {t['error']}")
            continue
        f = t["free_bytes"]
        print(f"  level {t['level']}: sleep {t['sleep_s']:.3f} s, wake {t['wake_s']:.3f} s, released "
              f"{t['bytes_released'] / GIB:.2f} GiB (meter {t['measured_released'] / GIB:.2f}), free "
              f"{f['before'] / GIB:.2f} -> {f['asleep'] / GIB:.2f} -> {f['after'] / GIB:.2f} GiB, "
              f"identical {t['identical']}")
    print(json.dumps(result["summary"], indent=2))
