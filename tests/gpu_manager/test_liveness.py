"""When is a lease's owner dead? Only when every thread of it is: a zombie main thread is not enough."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.gpu_manager.records import pid_start_time, process_alive

# The main thread leaves (pthread_exit: a zombie) while another thread still runs, as a SIGKILLed CUDA
# process's last thread still runs the context's teardown after the main thread is gone.
CHILD = r"""
import ctypes, sys, threading, time
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
sys.stdout.write("r\n"); sys.stdout.flush()
ctypes.CDLL(None).pthread_exit(None)
"""


def _state(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rfind(")") + 2:].split()[0]


def test_an_owner_whose_main_thread_is_a_zombie_but_another_thread_runs_is_alive_until_all_are_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "r\n"
        deadline = time.monotonic() + 10
        while _state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(child.pid) == "Z"  # the main thread is gone...
        start = pid_start_time(child.pid)
        assert start is not None and process_alive(child.pid, start)  # ...the process is not
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        assert pid_start_time(child.pid) is None and not process_alive(child.pid, start)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_live_process_has_its_start_time_and_a_reused_pid_does_not_pass_for_it() -> None:
    me = pid_start_time(os.getpid())
    assert me is not None and process_alive(os.getpid(), me)
    assert not process_alive(os.getpid(), me + 1)
