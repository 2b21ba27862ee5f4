"""Probe (device): what makes a SIGKILLed CUDA process's death take ~95 ms, the wait before a successor may write.

Why: under load (issue 17) a successor is assigned only once the predecessor's pidfd says dead, 96 ms after
the SIGKILL on the H200 (8b, 13 GiB weights + 16 GiB KV imported from the gpu_manager). The process stops
running code at once (PF_EXITING at 0.9 ms); the rest is the driver tearing down its CUDA context while the
kernel closes its files. Which part of what an engine holds sets that time decides what can be cut.

A child builds one configuration and says ready; this process SIGKILLs it and times the pidfd turning readable.
Configurations, comma-separated features (each run `--trials` times):
  ctx             torch.cuda.init() and one small tensor
  alloc:G         G GiB through torch's caching allocator
  map:G           G GiB of VMM chunks (1 GiB each) this process exports as fds, imported and mapped read-write
  shadow          this process also maps the exported chunks read-only (a standby's shadow)
  pinned:G        G GiB of pinned host memory (torch pin_memory)
  graphs:N        N CUDA graphs captured, each of 64 small kernels
  busy            kernels queued when the kill lands (a 20 ms backlog)
  writer          (with map:G) the child keeps ~2,000 tiny kernels queued, each adding 1 to a counter in the
                  shared memory: this process watches through its own mapping when the counter stops moving
  deep            (with writer) each add follows a 0.5 ms GPU spin (torch.cuda._sleep): hundreds of adds are
                  queued when the kill lands, ~100 ms of work: does the GPU run them after the process died?
  remap           (with map:G) right after the kill this process imports and maps every chunk afresh (what a
                  successor's takeover does) and times it: does it wait behind the dying context's teardown?
  python3 scripts/probe_teardown.py [--trials 3] ctx 'ctx,map:29' 'ctx,map:29,shadow' ...
Prints one JSON line per configuration: kill -> every thread PF_EXITING, kill -> pidfd readable (ms), and what
`writer` / `remap` saw.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CHUNK = 2**30

CHILD = r"""
import json, mmap, os, socket, sys, torch
s = socket.socket(fileno=int(sys.argv[1]))
feats = json.loads(sys.argv[2])
keep = []
torch.cuda.init()
keep.append(torch.ones(16, device="cuda"))
for f in feats:
    name, _, arg = f.partition(":")
    if name == "alloc":
        keep.append(torch.empty(int(float(arg) * 2**30), dtype=torch.uint8, device="cuda"))
    elif name == "map":
        from libs.client.mapping import CudaMapping
        spec = json.loads(sys.argv[3])
        m = CudaMapping(spec["fds"], spec["sizes"], None, 0)
        t = m.torch_bytes(0, sum(spec["sizes"]))
        t[:4096].fill_(1)
        keep += [m, t]
    elif name == "pinned":
        keep.append(torch.empty(int(float(arg) * 2**30), dtype=torch.uint8, pin_memory=True))
    elif name == "graphs":
        x = torch.ones(1024, device="cuda")
        st = torch.cuda.Stream()
        with torch.cuda.stream(st):
            for _ in range(3):
                x.add_(1)
        torch.cuda.synchronize()
        for _ in range(int(arg)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(64):
                    x.add_(1)
            keep.append(g)
torch.cuda.synchronize()
busy = "busy" in feats
if busy:
    a = torch.randn(4096, 4096, device="cuda")
writer = "writer" in feats
if writer:
    c = t[:8].view(torch.int64)
    c.zero_()
    torch.cuda.synchronize()
s.send(b"r")
while True:
    if writer and "deep" in feats:
        for _ in range(400):
            torch.cuda._sleep(1_000_000)
            c.add_(1)
    elif writer:
        for _ in range(2000):
            c.add_(1)
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            pass
    elif busy:
        for _ in range(40):
            a = a @ a
            a.clamp_(-1, 1)
        torch.cuda.synchronize()
    else:
        s.recv(1)
"""


def _export(gib: float) -> tuple[Any, list[Any], dict[str, list[int]]]:
    from services.gpu_manager.cuda_backend import CudaBackend

    backend = CudaBackend(["0"])
    total = int(gib * 2**30)
    gran = backend.granularity(0)
    sizes = [-(-min(CHUNK, total - off) // gran) * gran for off in range(0, total, CHUNK)]
    chunks = backend.allocate(0, sizes, "probe")
    return backend, chunks, {"fds": [c.fd for c in chunks], "sizes": sizes}


PF_EXITING = 0x4


def _all_exiting(pid: int) -> bool:
    """Every thread of `pid` is exiting (can run no more user code), or gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if not int(fields[6]) & PF_EXITING:
            return False
    return True


def _watch_counter(view: Any, t: float, pidfd: int, until_s: float = 0.5) -> dict[str, Any]:
    """Poll the shared counter: when it last moved (ms after the kill), how many reads it took, and when the
    pidfd turned readable meanwhile."""
    last, last_ms, reads, dead_ms = int(view.item()), 0.0, 0, None
    while time.perf_counter() - t < until_s:
        v = int(view.item())
        reads += 1
        if v != last:
            last, last_ms = v, (time.perf_counter() - t) * 1000
        if dead_ms is None and select.select([pidfd], [], [], 0)[0]:
            dead_ms = round((time.perf_counter() - t) * 1000, 1)
    return {"counter_last_moved_ms": round(last_ms, 1), "reads": reads, "pidfd_ms_while_watching": dead_ms}


def one(feats: list[str], trials: int) -> dict[str, Any]:
    gib = sum(float(f.split(":")[1]) for f in feats if f.startswith("map:"))
    backend = chunks = shadow = None
    spec: dict[str, list[int]] = {"fds": [], "sizes": []}
    if gib:
        backend, chunks, spec = _export(gib)
        if "shadow" in feats:
            from libs.client.mapping import CudaMapping

            shadow = CudaMapping([os.dup(fd) for fd in spec["fds"]], spec["sizes"], None, 0, read_only=True)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    deaths, readies, exiting, extra = [], [], [], []
    watch = None
    if "writer" in feats:
        from libs.client.mapping import CudaMapping

        watch_map = CudaMapping([os.dup(fd) for fd in spec["fds"]], spec["sizes"], None, 0, read_only=True)
        watch = watch_map.torch_bytes(0, 8).view(__import__("torch").int64)
    for _ in range(trials):
        a, b = socket.socketpair()
        t0 = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(b.fileno()), json.dumps(feats), json.dumps(spec)],
                                 pass_fds=[b.fileno(), *spec["fds"]], cwd=root, env=env)
        b.close()
        if a.recv(1) != b"r":
            raise SystemExit(f"child for {feats} failed (rc {child.wait()})")
        readies.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.3)
        fd = os.pidfd_open(child.pid)
        t = time.perf_counter()
        os.kill(child.pid, signal.SIGKILL)
        while not _all_exiting(child.pid):
            pass
        exiting.append((time.perf_counter() - t) * 1000)
        seen: dict[str, Any] = {}
        if "remap" in feats:
            from libs.client.mapping import CudaMapping

            t1 = time.perf_counter()
            m = CudaMapping([os.dup(f) for f in spec["fds"]], spec["sizes"], None, 0)
            seen["remap_started_ms"] = round((t1 - t) * 1000, 1)
            seen["remap_ms"] = round((time.perf_counter() - t1) * 1000, 1)
        if watch is not None:
            seen.update(_watch_counter(watch, t, fd))
        select.select([fd], [], [])
        deaths.append((time.perf_counter() - t) * 1000)
        if "remap" in feats:
            m.unmap()
        extra.append(seen)
        os.close(fd)
        child.wait()
        a.close()
    if watch is not None:
        watch_map.unmap()
    if shadow is not None:
        shadow.unmap()
    if backend is not None:
        backend.free(chunks)
    deaths.sort()
    return {"features": feats, "kill_to_pidfd_ms": [round(d, 1) for d in deaths],
            "p50_ms": round(deaths[len(deaths) // 2], 1), "max_ms": round(deaths[-1], 1),
            "child_setup_ms_p50": round(sorted(readies)[len(readies) // 2]),
            "kill_to_all_threads_exiting_ms": [round(e, 2) for e in exiting], "seen": extra}


def main() -> None:
    args = sys.argv[1:]
    trials = 3
    if args[:1] == ["--trials"]:
        trials, args = int(args[1]), args[2:]
    import torch

    torch.cuda.init()
    for conf in args or ["ctx"]:
        print(json.dumps(one([f for f in conf.split(",") if f], trials)), flush=True)


if __name__ == "__main__":
    main()
