"""The drain mark (engines/batched/drain.py) on a real GPU: `done` follows `launched` only once the queued work ran,
and a successor's fence ends as soon as a SIGKILLed engine's queue is proven drained, before its exit; a pass cut off
before its close proves nothing, so the fence waits for the exit (real child processes, a real SIGKILL)."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.batched.drain import DrainMark, await_fence, drained
from libs.common import procs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import mmap, os, sys, time, torch
from engines.batched.drain import DrainMark
fd, closes = int(sys.argv[1]), sys.argv[2] == "close"
m = mmap.mmap(fd, 4096)
page = torch.frombuffer(m, dtype=torch.int64, count=2)
mark = DrainMark(page, torch.device("cuda"))
mark.close()  # start-up's bracket
x = torch.ones(1 << 20, device="cuda")
mark.open()
x.mul_(2)  # the pass's work
if closes:
    mark.close()
torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(600)
"""


def _page() -> tuple[int, mmap.mmap, torch.Tensor]:
    fd = os.memfd_create("drain-test", 0)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    return fd, m, torch.frombuffer(m, dtype=torch.int64, count=2)


def test_done_follows_launched_only_after_the_queued_work_ran() -> None:
    _, _m, page = _page()
    mark = DrainMark(page, torch.device("cuda"))
    try:
        assert int(page[0]) == 1 and not drained(page)  # start-up's bracket, open
        mark.close()
        torch.cuda.synchronize()
        assert drained(page)
        mark.open()
        mark.open()  # nested: one bracket
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time queued before the close
        mark.close()
        assert int(page[0]) == 2 and int(page[1]) == 1  # the inner close queues nothing
        mark.close()
        assert not drained(page)  # queued, not run
        torch.cuda.synchronize()
        assert drained(page) and int(page[1]) == 2
    finally:
        mark.stop()


@pytest.mark.parametrize(("closes", "how"), [(True, "drained"), (False, "exited")])
def test_a_killed_engines_fence_ends_when_its_queue_is_proven_drained(closes: bool, how: str) -> None:
    fd, _m, page = _page()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(fd), "close" if closes else "open"], pass_fds=[fd],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        start = procs.start_time(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        assert await_fence(child.pid, start, page, cpu=False, timeout_s=30) == how
        if closes:  # proven before the CUDA context's teardown ended: the process is not reaped yet
            assert int(page[0]) == int(page[1]) == 2
        else:
            assert int(page[0]) == 2 and int(page[1]) == 1
    finally:
        child.kill()
        child.wait()
        os.close(fd)
