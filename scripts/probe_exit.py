"""Probe (device): how long after SIGKILL does a CUDA process's death become visible?

For a child that holds a CUDA context (torch) and N GiB of device memory, measure from os.kill to
(a) EOF on a unix socket the child holds (the agent link and the gpu_manager connection see this),
(b) its pidfd turning readable (what the agent waits for: the process fully gone),
(c) /proc/<pid>/stat showing PF_EXITING (the agent's early sign, services/agent/pidfd.proc_exiting).
Prints one JSON line per size.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import time

CHILD = r"""
import os, socket, sys, torch
s = socket.socket(fileno=int(sys.argv[1]))
x = torch.empty(int(float(sys.argv[2]) * 2**30), dtype=torch.uint8, device="cuda"); x.fill_(1)
torch.cuda.synchronize()
s.send(b"r")
import time
while True:
    time.sleep(1)
"""


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from services.agent.pidfd import proc_exiting  # noqa: E402


def one(gib: float) -> tuple[float, float, float]:
    parent, child = socket.socketpair()
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(child.fileno()), str(gib)], pass_fds=[child.fileno()])
    child.close()
    assert parent.recv(1) == b"r"
    pidfd = os.pidfd_open(p.pid)
    t0 = time.perf_counter()
    os.kill(p.pid, signal.SIGKILL)
    eof = pid = exiting = None
    poll = select.poll()
    poll.register(parent.fileno(), select.POLLIN | select.POLLHUP)
    poll.register(pidfd, select.POLLIN)
    while eof is None or pid is None:
        if exiting is None and proc_exiting(p.pid) is not None:
            exiting = (time.perf_counter() - t0) * 1000
        for fd, _ in poll.poll(0 if exiting is None else 5000):
            now = (time.perf_counter() - t0) * 1000
            if fd == pidfd and pid is None:
                pid = now
                poll.unregister(pidfd)
            elif fd == parent.fileno() and eof is None:
                eof = now
                poll.unregister(parent.fileno())
    p.wait()
    os.close(pidfd)
    parent.close()
    return eof, pid, exiting if exiting is not None else pid


for gib in (0.001, 16.0):
    runs = [one(gib) for _ in range(4)]
    print(json.dumps({"gib": gib, "socket_eof_ms": [round(a, 1) for a, _, _ in runs],
                      "pidfd_ms": [round(b, 1) for _, b, _ in runs],
                      "exiting_ms": [round(c, 2) for _, _, c in runs],
                      "eof_p50": round(statistics.median(a for a, _, _ in runs), 1),
                      "pidfd_p50": round(statistics.median(b for _, b, _ in runs), 1),
                      "exiting_p50": round(statistics.median(c for _, _, c in runs), 2)}), flush=True)
