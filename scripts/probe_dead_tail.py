"""Probe (device): does a SIGKILLed engine's already-queued GPU work slow its successor's first forward?

Why: on an H200 the successor's first prefill after a failover took ~1.7x an idle forward at 16 GiB and
120 GiB alike (docs/benchmarks.md), as if a second forward shared the GPU with it. A killed process's
kernels already queued may run on until its context is torn down, time-sliced against the successor's.

A "predecessor" child reads its own copy of a weight-sized set of matrices in forward-like passes (a
28-row activation times each matrix: bandwidth-bound, like a prefill), keeping `depth` passes queued, and is
SIGKILLed; this process, the "successor", already warm, times the same pass: alone, beside the busy child,
and back to back from the kill on. Prints one JSON line per depth.
  python3 scripts/probe_dead_tail.py [GIB] [DEPTHS...]     e.g. 16 1 4

2026-11-30 (H200, 16 GiB, own memory each): the first pass after the kill took 1.16-1.3x an idle one, the
next ones 1.0x: a killed process's queued work stops at once. What that left untested is the real case,
run with `shared` as the first argument:
  python3 scripts/probe_dead_tail.py shared [GIB] [DEPTHS...]
the weights in VMM chunks of 1 GiB (cuMemCreate, exported as fds: the gpu_manager's backend, which this
process plays), the child mapping them read-write and the successor read-only (an engine and its shadow),
so that the dying process's teardown unmaps 120 GiB-like mappings of memory the successor reads. Each pass is
also timed on the GPU (CUDA events): `gpu_ms` equal to the wall time means the pass ran slowly; smaller, that
it waited to start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

MATRIX = 8192 * 28672 * 2  # bytes of one bf16 matrix, Llama-3-70B's MLP width
CHUNK = 2**30  # the gpu_manager's default chunk (chunk_mib 1024)

CHILD = r"""
import json, socket, sys, torch
s = socket.socket(fileno=int(sys.argv[1]))
gib, depth = float(sys.argv[2]), int(sys.argv[3])
n = max(1, round(gib * 2**30 / (8192 * 28672 * 2)))
shared = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
if shared:  # the engine: a read-write mapping of the manager's chunks, its weights written through it
    from libs.client.mapping import CudaMapping
    torch.cuda.init()
    m = CudaMapping(shared["fds"], shared["sizes"], None, 0)
    flat = m.torch_bytes(0, n * 8192 * 28672 * 2).view(torch.bfloat16)
    ws = [w.view(8192, 28672) for w in flat.split(8192 * 28672)]
    for w in ws:
        w.normal_()
else:
    ws = [torch.randn(8192, 28672, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
x = torch.randn(28, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
s.send(b"r")
while True:
    for _ in range(depth):
        for w in ws:
            x[:, :1] = (x @ w)[:, :1]
    torch.cuda.synchronize()
"""


def one_pass(ws: list[torch.Tensor], x: torch.Tensor) -> tuple[float, float]:
    """(wall ms, GPU ms) of one pass."""
    t = time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for w in ws:
        x[:, :1] = (x @ w)[:, :1]
    end.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000, start.elapsed_time(end)


def _median(values: list[float]) -> float:
    return round(sorted(values)[len(values) // 2], 2)


def _shared_chunks(n: int) -> tuple[Any, list[Any], dict[str, list[int]]]:
    """The gpu_manager's part: VMM chunks holding `n` matrices, exported as fds."""
    from services.gpu_manager.cuda_backend import CudaBackend

    backend = CudaBackend(["0"])
    total = n * MATRIX
    sizes = [min(CHUNK, total - off) for off in range(0, total, CHUNK)]
    gran = backend.granularity(0)
    sizes = [-(-size // gran) * gran for size in sizes]
    chunks = backend.allocate(0, sizes, "probe")
    return backend, chunks, {"fds": [c.fd for c in chunks], "sizes": sizes}


def run(gib: float, depth: int, shared: bool) -> dict[str, object]:
    n = max(1, round(gib * 2**30 / MATRIX))
    extra: list[str] = []
    fds: list[int] = []
    mapping: Any = None
    backend: Any = None
    chunks: Any = None
    flat: Any = None
    if shared:  # the successor reads the very memory the child writes, through a read-only mapping (a shadow)
        from libs.client.mapping import CudaMapping

        torch.cuda.init()
        backend, chunks, spec = _shared_chunks(n)
        fds = list(spec["fds"])
        mapping = CudaMapping([os.dup(fd) for fd in fds], spec["sizes"], None, 0, read_only=True)
        flat = mapping.torch_bytes(0, n * MATRIX).view(torch.bfloat16)
        ws = [w.view(8192, 28672) for w in flat.split(8192 * 28672)]
        extra = [json.dumps(spec)]
    else:
        ws = [torch.randn(8192, 28672, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    x = torch.randn(28, 8192, device="cuda", dtype=torch.bfloat16)

    def idle() -> list[tuple[float, float]]:
        for _ in range(3):
            one_pass(ws, x)
        return [one_pass(ws, x) for _ in range(8)]

    alone = [] if shared else idle()  # shared: once the child has written the weights
    a, b = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(b.fileno()), str(gib), str(depth), *extra],
                             pass_fds=[b.fileno(), *fds], cwd=Path(__file__).resolve().parents[1],
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])})
    b.close()
    a.recv(1)
    if shared:  # the successor's idle figure, the child paused (its queued passes done within 0.2 s)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.2)
        alone = idle()
        os.kill(child.pid, signal.SIGCONT)
    time.sleep(1.0)
    beside = [one_pass(ws, x) for _ in range(8)]
    t_kill = time.perf_counter()
    os.kill(child.pid, signal.SIGKILL)
    after: list[tuple[float, float, float]] = []
    while time.perf_counter() - t_kill < 0.6:
        start = (time.perf_counter() - t_kill) * 1000
        wall, gpu = one_pass(ws, x)
        after.append((round(start, 1), round(wall, 2), round(gpu, 2)))
    child.wait()
    time.sleep(2.0)
    later = [one_pass(ws, x) for _ in range(5)]
    med = _median([w for w, _ in alone])
    out = {"gib": gib, "depth": depth, "shared": shared, "pass_alone_ms": med,
           "pass_alone_gpu_ms": _median([g for _, g in alone]),
           "pass_beside_busy_ms": _median([w for w, _ in beside]),
           "after_kill_start_wall_gpu_ms": after[:16], "first_after_kill_over_alone": round(after[0][1] / med, 2),
           "pass_2s_later_ms": _median([w for w, _ in later])}
    ws.clear()
    flat = None
    if mapping is not None:
        mapping.unmap()
        backend.free(chunks)
    torch.cuda.empty_cache()
    return out


def main() -> None:
    args = sys.argv[1:]
    shared = bool(args) and args[0] == "shared"
    args = args[1:] if shared else args
    gib = float(args[0]) if args else 16.0
    for depth in [int(d) for d in args[1:]] or [1, 4]:
        print(json.dumps(run(gib, depth, shared)), flush=True)


if __name__ == "__main__":
    main()
