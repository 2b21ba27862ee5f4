"""Probe (device): which first operation of a warm successor waits behind a dying CUDA process's teardown?

A predecessor child holds a CUDA context with GiBs allocated and runs kernels; this process (the successor)
is warm: every op below ran before, on this thread and on earlier threads. Per trial one op runs first,
2 ms after the predecessor's SIGKILL, timed with a synchronize; the pidfd says when the teardown ended.
Ops: pageable host->device copy (torch.tensor(list, device=cuda)), pinned host->device copy, a fill
kernel with the value as its argument (no copy), a matmul, a device->host read (.item()); each on the
main thread, on a new thread, and on a long-lived worker thread that ran it before.
Prints one JSON line per trial.
"""

from __future__ import annotations

import json
import os
import queue
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
x = torch.empty(int(sys.argv[2]) << 30, dtype=torch.uint8, device="cuda"); x.fill_(1)
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
s.send(b"r")
while True:
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""

DEV = torch.device("cuda")
W = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16)
PINNED = torch.empty(64, dtype=torch.long, pin_memory=True)
IDS = torch.empty(64, dtype=torch.long, device=DEV)
TOKENS = list(range(3, 31))


def h2d_pageable() -> None:
    torch.tensor(TOKENS, dtype=torch.long, device=DEV)


def h2d_pinned() -> None:
    PINNED[: len(TOKENS)] = torch.tensor(TOKENS, dtype=torch.long)
    IDS[: len(TOKENS)].copy_(PINNED[: len(TOKENS)], non_blocking=True)


def fill() -> None:
    IDS[:1].fill_(TOKENS[0])


def matmul() -> None:
    torch.tanh(W[:28] @ W)


def d2h() -> None:
    W[0, 0].item()


OPS = {"h2d_pageable": h2d_pageable, "h2d_pinned": h2d_pinned, "fill": fill, "matmul": matmul, "d2h": d2h}


def timed(op) -> float:
    t = time.perf_counter()
    op()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000


class Worker:
    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()
        self.out: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            op = self.q.get()
            self.out.put(timed(op))

    def __call__(self, op) -> float:
        self.q.put(op)
        return self.out.get()


def in_new_thread(op) -> float:
    box: list[float] = []
    t = threading.Thread(target=lambda: box.append(timed(op)))
    t.start()
    t.join()
    return box[0]


WORKER = Worker()
WHERE = {"main": timed, "new_thread": in_new_thread, "worker": WORKER}


def warm() -> None:
    for _ in range(3):
        for op in OPS.values():
            for run in WHERE.values():
                run(op)


def trial(op_name: str, where: str, gib: int) -> dict:
    parent, child = socket.socketpair()
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(child.fileno()), str(gib)], pass_fds=[child.fileno()])
    child.close()
    assert parent.recv(1) == b"r"
    warm()
    pidfd = os.pidfd_open(p.pid)
    t0 = time.perf_counter()
    os.kill(p.pid, signal.SIGKILL)
    time.sleep(0.002)
    ms = WHERE[where](OPS[op_name])
    done = (time.perf_counter() - t0) * 1000
    select.select([pidfd], [], [], 5)
    dead = (time.perf_counter() - t0) * 1000
    p.wait()
    os.close(pidfd)
    parent.close()
    return {"op": op_name, "where": where, "gib": gib, "op_ms": round(ms, 2), "op_done_at_ms": round(done, 1),
            "pidfd_ms": round(dead, 1)}


if __name__ == "__main__":
    gib = int(os.environ.get("PROBE_GIB", "8"))
    warm()
    for where in ("new_thread", "worker", "main"):
        for name in OPS:
            print(json.dumps(trial(name, where, gib)), flush=True)
