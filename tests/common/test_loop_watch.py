"""The loop watch records a wake-up its loop was kept from (a blocking call in a task), and none while it idles."""

from __future__ import annotations

import asyncio
import time

from libs.common.loop_watch import LoopWatch


async def test_a_loop_held_by_a_blocking_call_is_recorded_with_how_late_it_woke() -> None:
    watch = LoopWatch(0.002, late_ms=5.0)
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(0.05)
    t_block = time.time()
    time.sleep(0.06)  # the loop held 60 ms
    await asyncio.sleep(0.02)
    task.cancel()
    held = [(at, ms) for at, ms in watch.recent() if at >= t_block]
    assert held and max(ms for _, ms in held) >= 40
