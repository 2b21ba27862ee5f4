"""Probe (device): does a SIGKILLed engine's already-queued GPU work slow its successor's first forward?

Why: on an H200 the successor's first prefill after a failover took ~1.7x an idle forward at 16 GiB and
120 GiB alike (docs/benchmarks.md), as if a second forward shared the GPU with it. A killed process's
kernels already queued may run on until its context is torn down, time-sliced against the successor's.

A "predecessor" child reads its own copy of a weight-sized set of matrices in forward-like passes (a
28-row activation times each matrix: bandwidth-bound, like a prefill), keeping `depth` passes queued, and is
SIGKILLed; this process, the "successor", already warm, times the same pass: alone, beside the busy child,
and back to back from the kill on. Prints one JSON line per depth.
  python3 scripts/probe_dead_tail.py [GIB] [DEPTHS...]     e.g. 16 1 4
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch

CHILD = r"""
import socket, sys, torch
s = socket.socket(fileno=int(sys.argv[1]))
gib, depth = float(sys.argv[2]), int(sys.argv[3])
n = max(1, round(gib * 2**30 / (8192 * 28672 * 2)))
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


def one_pass(ws: list[torch.Tensor], x: torch.Tensor) -> float:
    t = time.perf_counter()
    for w in ws:
        x[:, :1] = (x @ w)[:, :1]
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000


def run(gib: float, depth: int) -> dict[str, object]:
    n = max(1, round(gib * 2**30 / (8192 * 28672 * 2)))
    ws = [torch.randn(8192, 28672, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    x = torch.randn(28, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        one_pass(ws, x)
    alone = [one_pass(ws, x) for _ in range(8)]
    a, b = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(b.fileno()), str(gib), str(depth)], pass_fds=[b.fileno()])
    b.close()
    a.recv(1)
    time.sleep(1.0)
    beside = [one_pass(ws, x) for _ in range(8)]
    t_kill = time.perf_counter()
    os.kill(child.pid, signal.SIGKILL)
    after: list[tuple[float, float]] = []
    while time.perf_counter() - t_kill < 0.6:
        start = (time.perf_counter() - t_kill) * 1000
        after.append((round(start, 1), round(one_pass(ws, x), 2)))
    child.wait()
    time.sleep(2.0)
    later = [one_pass(ws, x) for _ in range(5)]
    del ws
    torch.cuda.empty_cache()
    med = sorted(alone)[len(alone) // 2]
    return {"gib": gib, "depth": depth, "pass_alone_ms": round(med, 2),
            "pass_beside_busy_ms": round(sorted(beside)[len(beside) // 2], 2),
            "after_kill_start_and_ms": after[:12], "first_after_kill_over_alone": round(after[0][1] / med, 2),
            "pass_2s_later_ms": round(sorted(later)[len(later) // 2], 2)}


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
    for depth in [int(d) for d in sys.argv[2:]] or [1, 4]:
        print(json.dumps(run(gib, depth)), flush=True)


if __name__ == "__main__":
    main()
