"""The drain mark (engines/batched/drain.py) on a real GPU: `done` follows `launched` only once the queued work ran;
a SIGKILLed engine's fence ends as soon as its queue is proven drained, or, for an isolated takeover, as soon as its
threads are exiting, with exactly the blocks its queue may still write pending; a successor writing elsewhere keeps
what it wrote while the dead engine's queue runs on (real child processes, a real SIGKILL, host memory written by
the dead engine's queued copies)."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.batched.drain import DrainMark, PageLayout, await_fence, pending
from libs.common import procs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
PAGES = PageLayout(slots=8, num_blocks=16)
BLOCK = 1 << 18  # int32 a block of the host "cache" the child writes

CHILD = r"""
import mmap, os, sys, time, torch
from engines.batched.copier import register_host
from engines.batched.drain import DrainMark, PageLayout
page_fd, kv_fd, closes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "close"
layout = PageLayout(slots=8, num_blocks=16)
pm = mmap.mmap(page_fd, layout.nbytes)
page = torch.frombuffer(pm, dtype=torch.int64, count=layout.numel)
km = mmap.mmap(kv_fd, 16 * (1 << 18) * 4)
kv = torch.frombuffer(km, dtype=torch.int32).view(16, 1 << 18)
register_host(kv)
mark = DrainMark(page, torch.device("cuda"), layout, 0)
mark.close()  # start-up's bracket
src = torch.full((1 << 18,), 7, dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
mark.open()
mark.touch_blocks([3, 4])
mark.touch_slots([2])
torch.cuda._sleep(400_000_000 if not closes else 1)  # ~0.2 s of GPU time queued before the writes
kv[3].copy_(src, non_blocking=True)
kv[4].copy_(src, non_blocking=True)
if closes:
    mark.close()
    torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(600)
"""


def _memfd(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, 0)
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes)


def _page(m: mmap.mmap) -> torch.Tensor:
    return torch.frombuffer(m, dtype=torch.int64, count=PAGES.numel)


def test_done_follows_launched_only_after_the_queued_work_ran() -> None:
    _, m = _memfd("drain-test", PAGES.nbytes)
    page = _page(m)
    mark = DrainMark(page, torch.device("cuda"), PAGES, 0)
    bank = PAGES.bank(page, 0)
    try:
        assert int(bank[0]) == 1 and pending(page, PAGES, 0).header  # start-up's bracket, open
        mark.close()
        torch.cuda.synchronize()
        assert pending(page, PAGES, 0).drained
        mark.open()
        mark.open()  # nested: one bracket
        mark.touch_blocks([5])
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time queued before the close
        mark.close()
        assert int(bank[0]) == 2 and int(bank[1]) == 1  # the inner close queues nothing
        mark.close()
        p = pending(page, PAGES, 0)
        assert not p.drained and p.blocks == {5} and not p.slots and not p.header  # queued, not run
        torch.cuda.synchronize()
        assert pending(page, PAGES, 0).drained and int(bank[1]) == 2
        assert int(PAGES.bank(page, 1)[0]) == 0  # the other generation's bank untouched
    finally:
        mark.stop()


@pytest.mark.parametrize(("closes", "isolate", "how"), [(True, False, "drained"), (False, False, "exited"),
                                                         (False, True, "isolated")])
def test_a_killed_engines_fence(closes: bool, isolate: bool, how: str) -> None:
    page_fd, pm = _memfd("drain-test", PAGES.nbytes)
    kv_fd, km = _memfd("kv-test", 16 * BLOCK * 4)
    page = _page(pm)
    kv = torch.frombuffer(km, dtype=torch.int32).view(16, BLOCK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(page_fd), str(kv_fd), "close" if closes else "open"],
                             pass_fds=[page_fd, kv_fd], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)

    def proven() -> str | None:
        p = pending(page, PAGES, 0)
        return "drained" if p.drained else "isolated" if isolate and not p.header else None

    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        start = procs.start_time(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        assert await_fence(child.pid, start, proven, timeout_s=30) == how
        p = pending(page, PAGES, 0)
        if closes:  # proven before the CUDA context's teardown ended: the process is not reaped yet
            assert p.drained and int(kv[3, 0]) == 7
            return
        assert p.blocks == {3, 4} and p.slots == {2} and not p.header
        if isolate:  # the successor writes what is not pending at once, while the dead engine's queue may run
            kv[5].fill_(11)
            assert await_fence(child.pid, start, None, timeout_s=30) == "exited"
            assert bool((kv[5] == 11).all())  # nothing of the dead engine wrote there
    finally:
        child.kill()
        child.wait()
        os.close(page_fd)
        os.close(kv_fd)
