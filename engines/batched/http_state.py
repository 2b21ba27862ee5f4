"""What the batched engine's HTTP thread and its main and step threads share (server.py serves from it): the
engine's state and the requests held until it serves, the outbox the step thread hands tokens through, and where
a first token's time went.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

from engines.batched.engine import LLMEngine
from engines.batched.live import Request
from libs.common.loop_watch import LoopWatch

HOLDING = frozenset({"standby", "loading"})  # states a request is held in (EngineState.until_serving); not
# "starting": warm_routes's request (its 503 is the point) comes then
class EngineState:
    def __init__(self, engine_id: str, model: str, size: str, max_model_len: int, max_waiting: int) -> None:
        self.engine_id, self.model, self.size = engine_id, model, size
        self.max_model_len, self.max_waiting = max_model_len, max_waiting
        self.state = "starting"  # starting, loading, standby, ready, stopping
        self.role = "active"
        self.engine: LLMEngine | None = None
        self.in_flight = 0
        self.info: dict[str, Any] = {}
        self.on_first_token: Callable[[float], None] | None = None
        self.outbox = Outbox()
        self.t_start: float | None = None  # perf_counter of a recovery's start (its assignment, or the process's)
        self.batched_sinks: dict[str, Sink] = {}  # request id -> sink, of requests streamed by /generate_many
        self.phases: collections.deque[dict[str, float]] = collections.deque(maxlen=256)  # recent first tokens'
        # A request that comes before the engine serves (a standby the router was told will take over:
        # EndpointRemoved.successor_id) waits up to `hold_s` for it, `held` at a time at most `max_waiting`.
        self.hold_s = 0.0
        self.held = 0
        self.first_held: float | None = None  # perf_counter of the first request held
        self.first_arrival: float | None = None  # perf_counter of the first POST's headers once not starting
        self.woken: float | None = None  # perf_counter when the loop first saw the engine ready (held requests go)
        # > 0: the first held request watches the HTTP loop this long (`loop_late`: where a recovery's requests
        # waited on the loop or on the interpreter)
        self.loop_watch_s = 0.0
        self._watch: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

    def become(self, new: str) -> None:
        """Any thread: the engine's state changes; held requests look again. The state is written before the loop
        is read, and `until_serving` sets the loop before it reads the state: a change is never missed."""
        self.state = new
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self.woken is None and self.state == "ready":
            self.woken = time.perf_counter()
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def until_serving(self) -> None:
        """Hold a request while the engine is not serving yet (HOLDING), at most `hold_s`."""
        if self.state not in HOLDING or self.hold_s <= 0 or self.held >= self.max_waiting:
            return
        loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_s
        self.held += 1
        if self.first_held is None:
            self.first_held = time.perf_counter()
            if self.loop_watch_s > 0 and self._watch is None:
                self._watch = loop.create_task(self._watch_loop(self.loop_watch_s))
        try:
            while True:
                if self._changed is None:
                    self._changed = asyncio.Event()
                changed = self._changed
                left = deadline - loop.time()
                if self.state not in HOLDING or left <= 0:
                    return
                try:
                    await asyncio.wait_for(changed.wait(), left)
                except TimeoutError:
                    return
        finally:
            self.held -= 1

    async def _watch_loop(self, span_s: float) -> None:
        """The loop's late wake-ups (1 ms ticks, > 2 ms late) for `span_s`, then written into the recovery's record
        as (ms after its assignment, ms late, CPU ms the loop's thread ran meanwhile): close to the lateness, the
        loop was busy; far below, its thread waited for the interpreter (or the kernel)."""
        watch = LoopWatch(0.001, late_ms=2.0)
        try:
            await asyncio.wait_for(watch.run(), span_s)
        except TimeoutError:
            pass
        rec = self.info.get("recovery")
        t0 = rec.get("t0_wall") if isinstance(rec, dict) else None
        if isinstance(rec, dict) and isinstance(t0, (int, float)):
            rec["loop_late"] = [(round((at - t0) * 1000, 1), ms, cpu) for at, ms, cpu in watch.recent()]

    def phase_stats(self) -> dict[str, dict[str, float]]:
        """Where recent requests' first-token time went (ms, p50 / max per phase: `PHASES`), for /health."""
        out = {}
        for name in PHASES:
            vals = sorted(p[name] for p in self.phases if name in p)
            if vals:
                out[name] = {"n": len(vals), "p50": vals[len(vals) // 2], "max": vals[-1]}
        return out


# A request's way to its first token (ms each, from engine.Request's timestamps and the first line's write):
# its head at the ASGI app -> the handler had its parsed body -> submitted (the response started, the request handed to the step thread) -> taken in by the step
# thread -> first launched in a step -> first token handed to its sink -> first token line yielded for writing.
PHASES = ("to_handler", "to_submit", "queued", "to_scheduled", "to_token", "to_write")


def first_token_phases(req: Request, t_written: float) -> dict[str, float]:
    marks = (req.t_arrival, req.t_received, req.t_submit, req.t_intake, req.t_scheduled, req.t_first_token, t_written)
    return {name: round((b - a) * 1000, 2) for name, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True) if a and b}


class Outbox:
    """The step thread's output for every request, handed to the HTTP loop once a pass (`flush`), not once a
    token: with 64 streams a wake-up per token was 6,400 a second, each taking the interpreter from the step
    thread. Items keep their order (one deque); `flush` schedules at most one drain at a time."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._items: collections.deque[tuple[Sink, tuple[str, Any]]] = collections.deque()
        self._scheduled = False

    def put(self, sink: Sink, item: tuple[str, Any]) -> None:
        self._items.append((sink, item))

    def flush(self) -> None:  # step thread
        if self._items and not self._scheduled and self.loop is not None:
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # HTTP loop; cleared before taking, so a put after it is taken or flushed again
        self._scheduled = False
        while self._items:
            sink, item = self._items.popleft()
            sink.deliver(item)


class Sink:
    """Hands the step thread's output to one request's coroutine, through the outbox. The coroutine takes all
    that came since it last looked in one wake-up (`take`): at 256 streams a wake-up and a write per token and
    stream were ~40 us of the interpreter each (CPU machine, bench of the HTTP path alone), beside the step
    thread's own work."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self._items: list[tuple[str, Any]] = []
        self._waiter: asyncio.Future[None] | None = None

    def token(self, token: int) -> None:  # step thread
        self.outbox.put(self, ("token", token))

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:  # step thread
        self.outbox.put(self, ("done", (reason, prompt_tokens, completion_tokens)))

    def deliver(self, item: tuple[str, Any]) -> None:  # HTTP loop
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[tuple[str, Any]]:  # HTTP loop: every item delivered since the last take, >= 1
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class FirstArrival:
    """Marks when the first POST came once the engine stood by or took over (its headers, before FastAPI reads and
    parses its body): a recovery's timeline tells the way to the engine from the engine's own parsing. A plain ASGI
    wrapper: nothing added to a streamed response's path."""

    def __init__(self, app: Any, state: EngineState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        state = self.state
        if scope["type"] == "http":  # every request's arrival (its `to_handler` phase): request.state.t_arrival
            scope.setdefault("state", {})["t_arrival"] = time.perf_counter()
        if state.first_arrival is None and scope["type"] == "http" and scope["method"] == "POST" \
                and state.state != "starting":
            state.first_arrival = time.perf_counter()
        await self.app(scope, receive, send)
