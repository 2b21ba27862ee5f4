"""A request that reaches the engine before it serves (a standby that routers were told will take over) is held
until it serves, and answered 503 `not_ready` if it does not within `hold_s` or it stops instead. The state is
changed from another thread here (in the front, the link's reader changes it on the loop). The first request served
hands the engine its marks for the recovery's timeline (`EngineSide.mark` puts them on the record)."""

from __future__ import annotations

import asyncio
import threading

from fastapi.responses import JSONResponse

from engines.batched.front_link import EngineSide
from engines.batched.http_state import EngineState
from engines.batched.server import _serving


class Marks:
    """The front's end of the link as _serving and the loop watch use it: the marks it would send."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, object]] = []

    def mark(self, name: str, value: object) -> None:
        self.marks.append((name, value))

    def status(self, state: str, role: str) -> None:  # the engine's end, for EngineSide
        pass


def _state(hold_s: float, max_waiting: int = 8) -> EngineState:
    state = EngineState("sb", "m", "tiny", 64, max_waiting)
    state.link = Marks()  # type: ignore[assignment]
    state.become("standby")
    state.hold_s = hold_s
    return state


def _later(delay_s: float, fn: object, *args: object) -> None:
    threading.Timer(delay_s, fn, args).start()  # type: ignore[arg-type]


async def test_a_request_held_by_a_standby_goes_on_the_moment_it_serves() -> None:
    state = _state(hold_s=60)
    _later(0.05, state.become, "loading")  # assigned: still held
    _later(0.15, state.become, "ready")
    got = await asyncio.wait_for(_serving(state), 10)  # long before hold_s: woken by the change
    assert got is state.link and state.held == 0 and state.first_held is not None


async def test_a_request_held_past_hold_s_or_when_the_engine_stops_gets_not_ready() -> None:
    state = _state(hold_s=0.2)
    got = await asyncio.wait_for(_serving(state), 10)
    assert isinstance(got, JSONResponse) and got.status_code == 503 and b"not_ready" in got.body
    state = _state(hold_s=60)
    _later(0.05, state.become, "stopping")
    got = await asyncio.wait_for(_serving(state), 10)
    assert isinstance(got, JSONResponse) and b"stopping" in got.body and state.held == 0


async def test_no_hold_when_it_is_off_or_as_many_are_held_as_the_queue_takes() -> None:
    for state in (_state(hold_s=0), _state(hold_s=60, max_waiting=0)):
        got = await asyncio.wait_for(_serving(state), 10)  # at once: nothing wakes a held one here
        assert isinstance(got, JSONResponse) and got.status_code == 503 and state.first_held is None


async def test_a_watched_hold_records_the_wake_and_the_loops_late_wake_ups_on_the_recovery() -> None:
    import time

    state = _state(hold_s=60)
    state.loop_watch_s = 0.4
    engine_side = EngineSide(Marks(), "sb", "m", "tiny")  # type: ignore[arg-type]
    engine_side.t_start = time.perf_counter()
    engine_side.info["recovery"] = {"t0_wall": time.time()}
    _later(0.1, state.become, "ready")
    got = await asyncio.wait_for(_serving(state), 10)
    assert got is state.link
    await asyncio.wait_for(_serving(state), 10)  # the marks go once
    busy_until = time.thread_time() + 0.03
    while time.thread_time() < busy_until:  # the loop busy for 30 ms of CPU: its watch sees it late, its thread on it
        pass
    await asyncio.sleep(0.5)  # the watch's span ends; its findings are handed on
    marks = state.link.marks  # type: ignore[union-attr]
    assert [name for name, _ in marks] == ["first_request", "first_held", "woken", "loop_late"]
    for name, value in marks:
        engine_side.mark(name, value)
    rec = engine_side.info["recovery"]
    assert 90 <= rec["woken_ms"] <= rec["first_request_ms"] and rec["first_held_ms"] < rec["woken_ms"]
    assert any(ms >= 25 and cpu >= 25 for _, ms, cpu in rec["loop_late"]), rec["loop_late"]
