"""The loop watch records a wake-up its loop was kept from (a blocking call in a task) and how much of it the
thread ran."""

from __future__ import annotations

import asyncio
import time

from libs.common.loop_watch import LoopWatch


async def test_a_loop_held_by_a_blocking_call_is_recorded_with_how_late_it_woke() -> None:
    watch = LoopWatch(0.002, late_ms=5.0)
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(0.05)
    t_block = time.time()
    time.sleep(0.06)  # the loop held 60 ms, the thread asleep
    await asyncio.sleep(0.02)
    task.cancel()
    held = [(at, ms, cpu) for at, ms, cpu in watch.recent() if at >= t_block]
    assert held and max(ms for _, ms, _ in held) >= 40
    assert max(cpu for _, _, cpu in held) < 30  # asleep, not busy: the thread ran little of it

async def test_a_loop_held_by_work_shows_the_cpu_it_ran() -> None:
    watch = LoopWatch(0.002, late_ms=5.0)
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(0.05)
    t_busy = time.time()
    end = time.thread_time() + 0.04
    while time.thread_time() < end:  # the loop held by 40 ms of work (CPU time: a loaded machine stretches the wall)
        pass
    await asyncio.sleep(0.02)
    task.cancel()
    held = [(ms, cpu) for at, ms, cpu in watch.recent() if at >= t_busy]
    ms, cpu = max(held, key=lambda h: h[1])
    assert cpu >= 35 and ms >= 35
