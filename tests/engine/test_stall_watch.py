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


def test_stack_dumps_name_a_thread_that_holds_the_interpreter_inside_a_call(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "stacks.txt"
    stall_watch.dump_stacks(path, 0.01, 0.3)
    hog = threading.Thread(target=lambda: time.sleep(0.2) or busy(0.1), name="hog")
    hog.start()
    hog.join()
    time.sleep(0.3)  # the dumps' span over: the file is closed
    text = path.read_text()
    assert text.startswith("stacks every 10 ms for 300 ms")
    assert text.count("Thread 0x") >= 10 and "in busy" in text and "in sleep" not in text.split("\n")[0]
