"""`holdfast bench restore --first-token` (on by default): each source's time from nothing to the first token of a new
engine (issue 21), in the same report as the lease fills of bench/restore.py and beside them.

Real parts: nats, etcd and a gpu_manager (devstack.stack, `services=("gpu_manager",)`, its artifacts on the disk
measured) and, per trial, a new batched engine process (`python -m engines.batched`, leased memory) started here.
An engine reaches a source only through its one cold path (libs/client/safetensors_io.restore_or_load): it asks
the node for its class's copy `<class>.weights` (the host tier's, else the artifact) and reads the file where
there is none. So each source is an engine class of its own, and the node holds exactly one copy for each:
- `file`: class `ft-file`, of which the node never has a copy (the cold path as it is);
- `host`: class `ft-host`, a host tier copy written from the last file engine's weights lease (`SnapshotLease`
  with `host_tier`, as the policy does after a first load; on cuda registered as written, its `register_s` in
  `copies`); the artifact that command writes beside it is deleted, so only the tier can serve (a fallback would
  read the file, and the report would say so);
- `artifact`: class `ft-artifact`, an artifact written from the same lease.
The copies are written once the file trials are done (the last file engine is kept until then; the host copy
first and its artifact deleted before the next is written: the disk holds the weights file and one artifact), and
the host tier's trials come before the artifact's (a run cut off by a time limit has the fastest source). The
weights file is the model's (`model_file`), written once: the restore bench's lease fills read it too.

Per trial: `spawn_to_ready_s` (process start to its ready file, polled every 10 ms), `ready_to_first_token_s`
(a streamed /generate request's first token line), `total_s`, and the engine's own word: the source that served
(`engine_source`, from its ready file's `memory.weights`), its `load_ms` and the restore's figures. An engine that
took another source than the one asked for is an error in the report. Before the timed starts one process imports
what an engine imports and touches the device (`warmup_s`): every timed start finds the libraries in the page
cache, as on a node that has run engines before, not only the first. The weights file and artifact files are
dropped from the page cache before each start that reads them (`in_memory_fs` says where that cannot work). After
its first token each engine is stopped and its leases reclaimed (force), so the next starts on an empty device.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.stats import pct
from devstack.pagecache import drop_cache
from devstack.scenario import in_memory_fs, make_weights
from devstack.stack import Stack, StackConfig
from libs.common import procs
from libs.common.bus import Bus
from libs.common.events import (
    ListLeases,
    ListLeasesReply,
    Reclaim,
    ReclaimReply,
    SnapshotLease,
    SnapshotReply,
    Tag,
)

GIB = 1024**3
# The restore bench's sources an engine can be served by, and the engine's name for each (the manager's artifact
# restore is the direct one); the other sources (peers, bounce and buffered variants) have no engine path.
ENGINE_SOURCE = {"file": "file", "artifact-direct": "artifact", "host": "host"}
CLASS = {"file": "ft-file", "artifact": "ft-artifact", "host": "ft-host"}
PROMPT = "The first token of a new engine"
POLL_S = 0.01
FIGURES = ("spawn_to_ready_s", "ready_to_first_token_s", "total_s", "load_ms")
WORK = "first-token"  # its folder in the restore bench's


def model_file(backend: str, weights_gib: float, work: Path) -> Path:
    """The engine's weights file, about `weights_gib` GiB (written once: the lease fills read it too)."""
    from bench.recovery import size_for

    work.mkdir(parents=True, exist_ok=True)
    size = size_for(backend, weights_gib)
    return make_weights(size, work / f"model-{size}.safetensors")


def engine_sources(sources: tuple[str, ...]) -> list[str]:
    """The engine sources timed for the restore bench's `sources`: the file always (the baseline, and the lease the
    copies are written from), then the artifact and the host tier where asked for (pure)."""
    asked = {ENGINE_SOURCE[s] for s in sources if s in ENGINE_SOURCE}
    return ["file", *(s for s in ("artifact", "host") if s in asked)]


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Per source: p50 and max of each figure over its trials, the sources the engines said served, and whether each
    was the one asked for (pure)."""
    out: dict[str, Any] = {}
    for source in dict.fromkeys(t["source"] for t in trials):
        rows = [t for t in trials if t["source"] == source and "error" not in t]
        row: dict[str, Any] = {"trials": len(rows), "engine_sources": sorted({t["engine_source"] for t in rows}),
                               "matches": bool(rows) and all(t["engine_source"] == source for t in rows)}
        for key in FIGURES:
            row[key] = pct([float(t[key]) for t in rows if t.get(key) is not None], digits=4, keys=("p50", "max"))
        out[source] = row
    return out


def side_by_side(report: dict[str, Any]) -> dict[str, Any]:
    """Per engine source: the lease fill of the restore bench (its seconds and GiB/s for its own weights size) beside
    a new engine's load as it reported it and its p50 times to ready and to the first token (pure)."""
    rows: dict[str, Any] = {}
    by_engine = {v: k for k, v in ENGINE_SOURCE.items()}
    for source, row in report["first_token"]["summary"].items():
        fill = by_engine[source]
        rows[source] = {"fill_source": fill, "fill_s": report["seconds"].get(fill),
                        "fill_gib_s": report["gib_s"].get(fill), "engine_load_ms": row["load_ms"]["p50"],
                        "to_ready_s": row["spawn_to_ready_s"]["p50"], "to_first_token_s": row["total_s"]["p50"]}
    return rows


class FirstTokenBench:
    """The stack, the model's weights file and the engines started on it (blocking: call off the event loop)."""

    def __init__(self, backend: str, weights_gib: float, work: Path, kv_cache_gib: float) -> None:
        self.backend, self.work, self.kv_cache_gib = backend, work, kv_cache_gib
        self.weights = model_file(backend, weights_gib, work)
        self.size = self.weights.stem.removeprefix("model-")
        self.artifacts = work / "artifacts"
        tier = int(self.weights.stat().st_size * 1.1) + GIB  # one copy of the weights, with room for its alignment
        self.stack = Stack(StackConfig.ephemeral(backend=backend, services=("gpu_manager",),
                                                 extra_env={"HF_HOST_TIER_BYTES": str(tier),
                                                            "HF_ARTIFACT_DIR": str(self.artifacts)}))
        self.running: dict[str, procs.Child] = {}

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "cuda" else "cpu"

    def warm_up(self) -> float:
        """One process importing what an engine imports and touching the device, untimed by the trials."""
        code = ("import torch, engines.batched.__main__, libs.client.memory; "
                f"torch.zeros(1, device={self.device!r}).sum().item()")
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                              env={**os.environ, **self.stack.env()})
        if done.returncode != 0:
            raise RuntimeError(f"warm-up exited {done.returncode}: {done.stderr[-2000:]}")
        return time.perf_counter() - t0

    def cached_out(self, source: str) -> None:
        """What this source's start reads from disk is not in the page cache (the host tier is memory by design)."""
        if source == "file":
            drop_cache([self.weights])
        elif source == "artifact":
            drop_cache(sorted((self.artifacts / f"{CLASS['artifact']}.weights").glob("data-*.bin")))

    def start(self, source: str, engine_id: str, timeout_s: float) -> dict[str, Any]:
        """A new engine of `source`'s class, timed from its process start to its ready file and to the first token of
        a streamed request; its ready file's word on its weights. It is left running (`stop` ends it)."""
        ready = self.work / f"{engine_id}.ready.json"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "engines.batched", "--weights", str(self.weights), "--size", self.size,
                "--id", engine_id, "--memory", "leased", "--agent", "off", "--device", self.device,
                "--max-num-seqs", "16", "--kv-cache-gib", str(self.kv_cache_gib), "--ready-file", str(ready)]
        env = {**self.stack.env(), "HF_ENGINE_CLASS": CLASS[source],
               "HF_GPU_MANAGER_SOCKET": str(self.stack.base_dir / "state" / "gpu_manager.sock")}
        self.cached_out(source)
        with httpx.Client(timeout=timeout_s) as client:
            t0 = time.perf_counter()
            child = procs.Child(engine_id, argv, env=env, log_path=self.stack.logs / f"{engine_id}.log").start()
            self.running[engine_id] = child
            while not ready.exists():
                if not child.alive() or time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(f"engine {engine_id} did not start: {self.stack.tail(engine_id, 30)}")
                time.sleep(POLL_S)
            t_ready = time.perf_counter()
            info = json.loads(ready.read_text())
            t_first, tokens = first_token(client, info["endpoint"])
        weights = (info.get("memory") or {}).get("weights") or {}
        return {"source": source, "engine_id": engine_id, "engine_source": weights.get("source"),
                "spawn_to_ready_s": round(t_ready - t0, 4), "ready_to_first_token_s": round(t_first - t_ready, 4),
                "total_s": round(t_first - t0, 4), "load_ms": weights.get("load_ms"),
                "restore": weights.get("restore"), "refused": weights.get("refused"), "tokens": tokens}

    def stop(self, engine_id: str) -> None:
        child = self.running.pop(engine_id, None)
        if child is not None:
            child.stop(30)

    def close(self) -> None:
        for engine_id in list(self.running):
            self.stop(engine_id)
        self.stack.stop()


def first_token(client: httpx.Client, endpoint: str) -> tuple[float, list[int]]:
    """The moment the first token line of a streamed greedy request came back, and its tokens (read to its end):
    every source's engine must answer the file engine's tokens, or its figure is a wrong model's."""
    t_first, tokens = None, []
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "ignore_eos": True, "temperature": 0.0}
    with client.stream("POST", endpoint + "/generate", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line:
                continue
            got = json.loads(line)
            if "token" in got:
                t_first = time.perf_counter() if t_first is None else t_first
                tokens.append(int(got["token"]))
            if got.get("error"):
                raise RuntimeError(f"the first request failed: {got}")
    if t_first is None:
        raise RuntimeError("the first request's stream ended without a token")
    return t_first, tokens


class Node:
    """The node commands the bench sends as the controller would: its leases, a snapshot, a forced reclaim."""

    def __init__(self, bus: Bus, node: str) -> None:
        self.bus, self.node = bus, node

    async def leases_of(self, engine_id: str) -> list[Any]:
        reply = await self.bus.request(self.node, ListLeases(), ListLeasesReply, timeout=30)
        return [x for x in reply.leases if x.owner == engine_id]

    async def reclaim_all(self, engine_id: str) -> None:
        for lease in await self.leases_of(engine_id):
            await self.bus.request(self.node, Reclaim(lease_id=lease.id, force=True), ReclaimReply, timeout=60)

    async def snapshot(self, engine_id: str, name: str, *, host_tier: bool) -> SnapshotReply:
        weights = [x for x in await self.leases_of(engine_id) if x.tag == Tag.WEIGHTS]
        if len(weights) != 1:
            raise RuntimeError(f"engine {engine_id} holds {len(weights)} weights leases, not one")
        return await self.bus.request(self.node, SnapshotLease(lease_id=weights[0].id, artifact=name,
                                                                host_tier=host_tier), SnapshotReply, timeout=1800)


async def measure(b: FirstTokenBench, ft: dict[str, Any], sources: list[str], trials: int, timeout_s: float,
                  step: Callable[[str], None]) -> None:
    """The trials into `ft` as they go: the file's, the copies written from the last file engine, then each copy's.
    A trial that fails is a row with its `error` and an entry in `ft["errors"]`; the other sources go on."""
    bus = await Bus.connect(b.stack.settings(), "bench-first-token", stream=False)
    node = Node(bus, b.stack.config.node)
    try:
        keep = ""  # the file engine the copies are written from

        async def trial(source: str, i: int, *, keep_running: bool = False) -> None:
            engine_id = f"ft-{source}-{i}"
            try:
                row = await asyncio.to_thread(b.start, source, engine_id, timeout_s)
                if row["engine_source"] != source:
                    ft["errors"][source] = f"asked for {source}, the engine loaded from {row['engine_source']} " \
                                           f"(refused: {row['refused'] or 'no copy'})"
                expect = next((t["tokens"] for t in ft["trials"] if t["source"] == "file" and "tokens" in t), None)
                if expect is not None and row["tokens"] != expect:
                    row["error"] = f"its greedy tokens {row['tokens']} are not the file engine's {expect}"
                    ft["errors"].setdefault(source, row["error"])
            except Exception as e:  # noqa: BLE001 - in the report; the other sources go on
                row = {"source": source, "engine_id": engine_id, "error": f"{type(e).__name__}: {e}"}
                ft["errors"].setdefault(source, row["error"])
                keep_running = False
            ft["trials"].append(row)
            ft["summary"] = summarize(ft["trials"])
            if not keep_running:
                await asyncio.to_thread(b.stop, engine_id)
                await node.reclaim_all(engine_id)
            step(f"first token: {source} trial {i + 1}")

        for i in range(trials):
            last = i == trials - 1 and len(sources) > 1
            await trial("file", i, keep_running=last)
            if last and f"ft-file-{i}" in b.running:
                keep = f"ft-file-{i}"
        copies = sorted(sources[1:], key=lambda x: x != "host")  # the host tier's first (its artifact goes first)
        for source in copies:
            if not keep:
                ft["errors"][source] = "no file engine to write its copy from"
                continue
            try:
                await write_copy(b, node, ft, keep, source)
            except Exception as e:  # noqa: BLE001 - in the report; the other copy goes on
                ft["errors"][source] = f"copy: {type(e).__name__}: {e}"
            step(f"first token: {source} copy written")
        if keep:
            await asyncio.to_thread(b.stop, keep)
            await node.reclaim_all(keep)
        for source in copies:
            if source in ft["copies"]:
                for i in range(trials):
                    await trial(source, i)
    finally:
        await bus.close()


async def write_copy(b: FirstTokenBench, node: Node, ft: dict[str, Any], engine_id: str, source: str) -> None:
    """`source`'s copy of `engine_id`'s weights under its class's name; for the host tier, the artifact the same
    command writes is deleted (only the tier serves that class)."""
    name = f"{CLASS[source]}.weights"
    reply = await node.snapshot(engine_id, name, host_tier=source == "host")
    if source == "host":
        await asyncio.to_thread(shutil.rmtree, b.artifacts / name)
    ft["copies"][source] = {"name": name, "bytes": reply.bytes, "write_s": reply.seconds, "gib_s": reply.gib_s,
                            "direct_io": reply.direct_io}
    if source == "host":  # cuda: page-locked as written, so the engines' restores register nothing
        ft["copies"][source].update(registered_at_write=reply.tier_registered, register_s=reply.tier_register_s)


def run(report: dict[str, Any], backend: str, weights_gib: float, work: Path, trials: int, sources: tuple[str, ...],
        step: Callable[[str], None], *, kv_cache_gib: float | None = None, timeout_s: float = 600.0) -> None:
    """The first-token part of the restore bench's `report` (`report["first_token"]`, with `side_by_side` once
    measured); a failure is in `report["errors"]` under `first_token` or `first_token:<source>`."""
    kv = kv_cache_gib or (1.0 if backend == "cuda" else 0.05)
    picked = engine_sources(sources)
    ft: dict[str, Any] = {"sources": picked, "kv_cache_gib": kv, "trials": [], "summary": {}, "copies": {},
                          "errors": {}}
    report["first_token"] = ft
    b: FirstTokenBench | None = None
    try:
        b = FirstTokenBench(backend, weights_gib, work, kv)
        ft["size"], ft["weights_file_gib"] = b.size, round(b.weights.stat().st_size / GIB, 3)
        ft["in_memory_fs"] = in_memory_fs(b.weights)
        with ThreadPoolExecutor(1) as pool:  # both take seconds, and neither needs the other
            warm = pool.submit(b.warm_up)
            b.stack.start(timeout=120)
            ft["warmup_s"] = round(warm.result(), 3)
        step("first token: stack up, libraries warm")
        asyncio.run(measure(b, ft, picked, trials, timeout_s, step))
        report["side_by_side"] = side_by_side(report)
    except Exception as e:  # noqa: BLE001 - in the report, which is printed either way
        ft["errors"]["run"] = f"{type(e).__name__}: {e}"
    finally:
        if b is not None:
            b.close()
        shutil.rmtree(work, ignore_errors=True)
        for source, why in ft["errors"].items():
            report["errors"]["first_token" if source == "run" else f"first_token:{source}"] = why
        step("first token: done")
