"""Probe (device): does a dying CUDA process's teardown stall another process's GPU work?

A "predecessor" child holds a CUDA context (busy with kernels, or idle) and is SIGKILLed; this process, the
"successor", already warm, keeps running one small forward-like step (matmuls + .item()) in a loop and
records how long each step takes, from the kill on. Variants: steps that reuse their memory, steps that
allocate a new size each time (cudaMalloc through the caching allocator), predecessor busy or idle, steps
each on a new thread (a fresh cuBLAS handle per thread unless the handle pool was primed by earlier threads).
Prints one JSON line per variant: the longest step, when it ended (ms after the kill), and the pidfd time.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

CHILD = r"""
import socket, sys, torch
s = socket.socket(fileno=int(sys.argv[1]))
busy = sys.argv[2] == "busy"
x = torch.empty(2**30, dtype=torch.uint8, device="cuda"); x.fill_(1)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
s.send(b"r")
import time
while True:
    if busy:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    else:
        time.sleep(1)
"""

W = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(20)]
X = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)


def step(alloc: int) -> None:
    h = X
    for w in W:
        h = torch.tanh(h @ w)
    if alloc:
        torch.empty(alloc, dtype=torch.uint8, device="cuda").fill_(0)  # a size the allocator has not cached
    h.sum().item()


def prime_pool(n: int) -> None:
    """n threads each run a step at once, then exit: PyTorch hands their cuBLAS handles to later threads."""
    barrier = threading.Barrier(n)

    def run() -> None:
        step(0)
        torch.cuda.synchronize()
        barrier.wait()

    ts = [threading.Thread(target=run) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def in_thread(alloc: int) -> None:
    t = threading.Thread(target=step, args=(alloc,))
    t.start()
    t.join()


def one(busy: bool, alloc: bool, threads: str = "main") -> dict:
    parent, child = socket.socketpair()
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(child.fileno()), "busy" if busy else "idle"],
                         pass_fds=[child.fileno()])
    child.close()
    assert parent.recv(1) == b"r"
    for _ in range(20):
        step(0)
    torch.cuda.synchronize()
    if threads == "new-primed":
        prime_pool(6)
    run = step if threads == "main" else in_thread
    base = []
    for _ in range(20):
        t = time.perf_counter()
        step(0)
        base.append((time.perf_counter() - t) * 1000)
    pidfd = os.pidfd_open(p.pid)
    t0 = time.perf_counter()
    os.kill(p.pid, signal.SIGKILL)
    steps, dead, n = [], None, 0
    while (time.perf_counter() - t0) < 0.4:
        t = time.perf_counter()
        n += 1
        run((64 << 20) + n * (2 << 20) if alloc else 0)
        end = time.perf_counter()
        steps.append(((end - t0) * 1000, (end - t) * 1000))
        if dead is None and select.select([pidfd], [], [], 0)[0]:
            dead = (time.perf_counter() - t0) * 1000
    p.wait()
    os.close(pidfd)
    parent.close()
    worst = max(steps, key=lambda s: s[1])
    return {"busy_predecessor": busy, "alloc_each_step": alloc, "threads": threads, "base_step_ms": round(sorted(base)[10], 2),
            "first_step_ms": round(steps[0][1], 2), "worst_step_ms": round(worst[1], 2),
            "worst_ended_at_ms": round(worst[0], 1), "steps": len(steps), "pidfd_ms": dead and round(dead, 1),
            "slow_steps": [(round(a, 1), round(b, 1)) for a, b in steps if b > 5 * sorted(base)[10]][:12]}


for busy, alloc, threads in ((True, False, "main"), (True, True, "main"), (True, False, "new"),
                             (True, False, "new-primed"), (False, True, "main")):
    print(json.dumps(one(busy, alloc, threads)), flush=True)
