"""How late a service's event loop runs: a task asks to wake every `tick_s` and records each wake-up that came
more than `late_ms` after it was due (wall time, ms late), the most recent `keep` of them.

Why: after a kill, the router received the controller's events 8-43 ms after they were published (H200, 64 + 16
streams), and nothing told whether its loop was busy (and with what moment) or the message was on its way. A
benchmark reads `recent()` (the router's `/stats` `loop_late`) and lines it up with its own timeline.
"""

from __future__ import annotations

import asyncio
import collections
import time


class LoopWatch:
    """Each late wake-up is kept as (wall time, ms late, CPU ms the loop's thread ran since its last wake-up): a
    loop busy with work shows CPU close to the lateness; one the kernel did not run (a loaded machine) shows little."""

    def __init__(self, tick_s: float, *, late_ms: float = 1.0, keep: int = 4096) -> None:
        self.tick_s, self.late_ms = tick_s, late_ms
        self.late: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=keep)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.tick_s
        cpu = time.thread_time()
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            now, cpu_now = loop.time(), time.thread_time()
            late = (now - due) * 1000
            if late > self.late_ms:
                self.late.append((time.time(), round(late, 2), round((cpu_now - cpu) * 1000, 2)))
            due, cpu = now + self.tick_s, cpu_now

    def recent(self) -> list[tuple[float, float, float]]:
        return list(self.late)
