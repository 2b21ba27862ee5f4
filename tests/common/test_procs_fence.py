"""`procs.stopped` and `procs.wait_gone`: the two halves of a fenced takeover (the grant once the predecessor can
run no code; the first write once it has exited), on real processes and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from libs.common import procs

SLEEPER = "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); time.sleep(60)"


def _wait(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_running_or_signal_stopped_process_is_neither_stopped_nor_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        _wait(lambda: len(os.listdir(f"/proc/{child.pid}/task")) >= 2)
        start = procs.start_time(child.pid)
        assert start is not None
        assert not procs.stopped(child.pid, start)
        assert not procs.wait_gone(child.pid, start, 0.05)
        os.kill(child.pid, signal.SIGSTOP)  # may be continued: it can still run code
        _wait(lambda: (procs.stat_fields(child.pid) or [b""])[0] == b"T")
        assert not procs.stopped(child.pid, start)
        assert not procs.wait_gone(child.pid, start, 0.05)
    finally:
        child.kill()
        child.wait()


def test_a_killed_process_is_stopped_then_gone_even_before_it_is_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        _wait(lambda: len(os.listdir(f"/proc/{child.pid}/task")) >= 2)
        start = procs.start_time(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        _wait(lambda: procs.stopped(child.pid, start))
        assert procs.wait_gone(child.pid, start, 10.0)  # a zombie: exited, not reaped yet
        assert (procs.stat_fields(child.pid) or [b"Z"])[0] == b"Z"
        assert procs.stopped(child.pid, start)
    finally:
        child.wait()


def test_a_pid_naming_another_process_or_none_is_gone() -> None:
    me = os.getpid()
    start = procs.start_time(me)
    assert start is not None
    assert not procs.stopped(me, start)
    assert procs.stopped(me, start + 1) and procs.wait_gone(me, start + 1, 0.0)  # the pid was reused
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names nothing (or, later, another process)
    assert procs.stopped(child.pid, 0 if procs.start_time(child.pid) is None else -1)
    assert procs.wait_gone(child.pid, -1, 0.0)



@pytest.mark.parametrize("stop_first", [False, True])
def test_a_process_is_stopped_from_the_moment_a_kill_is_queued(stop_first: bool) -> None:
    """kill() returns once SIGKILL is queued; the threads may not have run to their exit yet (a loaded machine, a
    SIGSTOPped process): the queued kill alone says it can run no code of its own (a fenced takeover right after)."""
    child = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        _wait(lambda: len(os.listdir(f"/proc/{child.pid}/task")) >= 2)
        start = procs.start_time(child.pid)
        if stop_first:
            os.kill(child.pid, signal.SIGSTOP)
            _wait(lambda: (procs.stat_fields(child.pid) or [b""])[0] == b"T")
            assert not procs.kill_pending(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        assert procs.stopped(child.pid, start)  # at once: no wait
    finally:
        child.kill()
        child.wait()
