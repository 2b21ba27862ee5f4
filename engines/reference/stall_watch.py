"""Who holds the interpreter while a traced generation waits? A thread that sleeps 1 ms at a time, for a
short window, and notes each wake-up that came late, with where every other thread stood at that moment.

Why: on the H200 a promoted standby's first request reached its generation thread 13-20 ms after the HTTP
handler ran, though the same path takes ~1.5 ms in an idle process (docs/benchmarks.md). A late wake-up is
the GIL (or the CPU) taken by someone else; the other threads' frames say who.
"""

from __future__ import annotations

import sys
import threading
import time


def _where(frame) -> str:  # noqa: ANN001 - a frame object
    code = frame.f_code
    return f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}"


def watch(into: list[dict], seconds: float, *, late_ms: float = 3.0, keep: int = 8) -> threading.Thread:
    """Start watching for `seconds`; append up to `keep` late wake-ups to `into` (ms after the start, how
    late, and each other thread's innermost frame)."""
    names = {t.ident: t.name for t in threading.enumerate()}

    def run() -> None:
        me = threading.get_ident()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds and len(into) < keep:
            before = time.perf_counter()
            time.sleep(0.001)
            late = (time.perf_counter() - before) * 1000 - 1.0
            if late >= late_ms:
                names.update({t.ident: t.name for t in threading.enumerate()})
                frames = {names.get(tid, str(tid)): _where(f) for tid, f in sys._current_frames().items() if tid != me}
                into.append({"at_ms": round((before - t0) * 1000, 1), "late_ms": round(late, 1), "threads": frames})

    thread = threading.Thread(target=run, name="stall-watch", daemon=True)
    thread.start()
    return thread
