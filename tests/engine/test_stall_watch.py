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
