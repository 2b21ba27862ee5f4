"""The stall watcher notes late wake-ups and where the other threads stood: here, a thread that keeps the
interpreter busy in pure Python."""

from __future__ import annotations

import sys
import threading
import time

from engines.reference import stall_watch


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(2000))


def test_a_thread_holding_the_interpreter_is_named_in_the_late_wake_ups() -> None:
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.02)  # the busy thread keeps the interpreter 20 ms at a time
    try:
        stalls: list[dict] = []
        watcher = stall_watch.watch(stalls, 0.5, late_ms=5.0)
        hog = threading.Thread(target=busy, args=(0.4,), name="hog")
        hog.start()
        hog.join()
        watcher.join()
    finally:
        sys.setswitchinterval(old)
    assert stalls, "no late wake-up seen while a thread held the interpreter"
    assert any("busy" in s["threads"].get("hog", "") for s in stalls)
    assert all(s["late_ms"] >= 5.0 for s in stalls) and len(stalls) <= 8


def nap(seconds: float) -> None:
    time.sleep(seconds)  # in the kernel (state S), the interpreter let go: nobody wakes late


def test_a_thread_held_in_the_kernel_is_noted_with_the_call_it_made() -> None:
    stalls: list[dict] = []
    # A nap long enough that a watcher slowed by a loaded machine still notes 100 ms of it (CI: 47.6 ms noted of a
    # 150 ms nap; 20.6 ms of a 500 ms one, the watcher starved ~480 ms by a full test run plus a type check beside it)
    napper = threading.Thread(target=nap, args=(1.5,), name="napper")
    # S stands in for D here (the engine watches D: a kernel wait no signal ends); the same reading of /proc
    # keep: room for every late wake-up of a starved watcher besides the nap (at most 1.8 s / 20 ms of them): with 8,
    # a loaded CI run filled it with late wake-ups and the watch ended 20 ms into the nap (its episode stops growing)
    watcher = stall_watch.watch(stalls, 1.8, late_ms=20.0, keep=100, blocked_states=("S",))
    napper.start()  # a thread started after the watch: found at its next look at the threads (50 ms)
    napper.join()
    watcher.join()
    naps = [s for s in stalls if s.get("blocked") == "napper"]
    assert len(naps) == 1, stalls
    assert any("nap" in f for f in naps[0]["frames"]), naps[0]
    assert naps[0]["for_ms"] >= 100.0 and naps[0]["wchan"] is not None
