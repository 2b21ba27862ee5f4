"""Who holds the interpreter while a traced generation waits? A thread that sleeps 1 ms at a time, for a
short window, and notes each wake-up that came late, with where every other thread stood at that moment.

Why: on the H200 a promoted standby's first request reached its generation thread 13-20 ms after the HTTP
handler ran, though the same path takes ~1.5 ms in an idle process (docs/benchmarks.md). A late wake-up is
the GIL (or the CPU) taken by someone else; the other threads' frames say who.

A thread can also stop outside the interpreter: blocked in the kernel (state D) it holds no GIL, so nobody wakes
late, yet its own work waits. The watch therefore also reads each other thread's state in /proc at every tick and
notes each such episode that lasts `late_ms` or more: the thread, its Python frames where it made the call, the
kernel's wait channel, system call and (where readable) kernel stack, and how long it lasted.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from libs.common import procs


def _where(frame) -> str:  # noqa: ANN001 - a frame object
    code = frame.f_code
    return f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}"


def _read(path: str, limit: int = 2048) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace").strip()
    except OSError:
        return None


def _state(tid: int) -> str | None:
    """A thread of this process's scheduler state (R, S, D, ...) from /proc, None once it is gone."""
    rest = procs.stat_fields(os.getpid(), tid=tid)
    return rest[0].decode() if rest else None


def _frames(frame, depth: int = 4) -> list[str]:  # noqa: ANN001 - a frame object
    out: list[str] = []
    while frame is not None and len(out) < depth:
        out.append(_where(frame))
        frame = frame.f_back
    return out


class _Blocked:
    """Episodes of other threads held in the kernel in `states`, noted once they lasted `late_ms`."""

    def __init__(self, into: list[dict], states: tuple[str, ...], late_ms: float, keep: int) -> None:
        self.into, self.states, self.late_ms, self.keep = into, states, late_ms, keep
        self.open: dict[int, dict[str, Any]] = {}  # native id -> its episode (noted in `into` once long enough)
        self.noted: set[int] = set()  # the native ids whose open episode is in `into` (its `for_ms` still grows)

    def tick(self, now_ms: float, threads: list[threading.Thread], me: int) -> None:
        frames = None
        for t in threads:
            tid = t.native_id
            if tid is None or t.ident == me:
                continue
            ep = self.open.get(tid)
            if _state(tid) not in self.states:
                if ep is not None:
                    del self.open[tid]
                    self.noted.discard(tid)
                continue
            if ep is None:  # where it stands now: the call it is blocked in
                frames = frames if frames is not None else sys._current_frames()
                f = frames.get(t.ident) if t.ident is not None else None
                ep = self.open[tid] = {"at_ms": round(now_ms, 1), "blocked": t.name, "for_ms": 0.0,
                                       "frames": _frames(f) if f is not None else [],
                                       "wchan": _read(f"/proc/self/task/{tid}/wchan", 128),
                                       "syscall": (_read(f"/proc/self/task/{tid}/syscall", 256) or "").split(" ")[0],
                                       "kernel_stack": (_read(f"/proc/self/task/{tid}/stack") or "").splitlines()[:12]}
            ep["for_ms"] = round(now_ms - ep["at_ms"], 1)  # the one key changed once noted (/health may read it)
            if tid not in self.noted and ep["for_ms"] >= self.late_ms and len(self.into) < self.keep:
                self.noted.add(tid)
                self.into.append(ep)


def watch(into: list[dict], seconds: float, *, late_ms: float = 3.0, keep: int = 8,
          blocked_states: tuple[str, ...] = ("D",)) -> threading.Thread:
    """Start watching for `seconds`; append up to `keep` records to `into`: late wake-ups (ms after the start,
    how late, and each other thread's innermost frame) and episodes of another thread blocked `late_ms` or more in
    the kernel in one of `blocked_states` (`blocked`: the thread's name; `for_ms`, its frames, wchan, syscall)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    blocked = _Blocked(into, blocked_states, late_ms, keep)

    def run() -> None:
        me = threading.get_ident()
        t0 = time.perf_counter()
        threads = threading.enumerate()
        while time.perf_counter() - t0 < seconds and len(into) < keep:
            before = time.perf_counter()
            time.sleep(0.001)
            late = (time.perf_counter() - before) * 1000 - 1.0
            if late >= late_ms:
                names.update({t.ident: t.name for t in threading.enumerate()})
                frames = {names.get(tid, str(tid)): _where(f) for tid, f in sys._current_frames().items() if tid != me}
                into.append({"at_ms": round((before - t0) * 1000, 1), "late_ms": round(late, 1), "threads": frames})
            if int((before - t0) * 20) != int((time.perf_counter() - t0) * 20):  # every 50 ms: new threads
                threads = threading.enumerate()
            blocked.tick((time.perf_counter() - t0) * 1000, threads, me)

    thread = threading.Thread(target=run, name="stall-watch", daemon=True)
    thread.start()
    return thread
