"""The batched engine's HTTP front's state (front.py; server.py serves from it): the engine's state as its last
`Status` said, the requests held until it serves, each request's sink, and where a first token's time went. No
torch here: the front runs in a process of its own (front_link.py says why).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from libs.common.loop_watch import LoopWatch

if TYPE_CHECKING:
    from engines.batched.front_link import EngineLink

HOLDING = frozenset({"standby", "loading"})  # states a request is held in (EngineState.until_serving); not
# "starting": warm_routes's request (its 503 is the point) comes then
SUPERSEDED = "superseded"  # a request's end: a newer request under its id replaced it (`EngineState.run`)


class EngineState:
    def __init__(self, engine_id: str, model: str, size: str, max_model_len: int, max_waiting: int) -> None:
        self.engine_id, self.model, self.size = engine_id, model, size
        self.max_model_len, self.max_waiting = max_model_len, max_waiting
        self.state = "starting"  # starting, loading, standby, ready, sleeping, stopping
        self.role = "active"
        self.link: EngineLink | None = None  # the engine, through the link (set at the front's start)
        self.in_flight = 0
        self.marked = False  # the recovery's marks sent to the engine (once: the first request served)
        self.requests: dict[str, Running] = {}  # request id -> the request this front runs under it (`run`)
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
        self.http_stats: Callable[[], dict[str, Any]] = dict  # the front door's counters (server.py `front_door`)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

    def run(self, request_id: str, running: Running, link: EngineLink) -> None:
        """`running` is the request under `request_id` from now on (until `ended`). Invariant: one request an id at a
        time. An older one under the same id (a client's retry, or a router's that gave up on it) ends now with a
        final `superseded` line and its sequence is aborted, before the newer one is submitted. Without it the
        engine's "newer wins" dropped the older one's sequence without ending its stream (a `/generate_many`
        naming one id twice never ended), and the older one's client leaving later aborted the id: by then the
        newer one's sequence."""
        older = self.requests.get(request_id)
        if older is not None:
            link.abort(older.key, request_id)
            older.sink.deliver(("done", (SUPERSEDED, 0, 0)))
        self.requests[request_id] = running

    def ended(self, request_id: str, key: int) -> None:
        """The request `key` under `request_id` ended (a newer one under the id stays)."""
        running = self.requests.get(request_id)
        if running is not None and running.key == key:
            del self.requests[request_id]

    def apply_status(self, state: str, role: str) -> None:
        """The engine's `Status`, from the link."""
        self.role = role
        self.become(state)

    def become(self, new: str) -> None:
        """The engine's state changes (its `Status`); held requests look again. The state is written before the
        loop is read, and `until_serving` sets the loop before it reads the state: a change is never missed."""
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
        """The loop's late wake-ups (1 ms ticks, > 2 ms late) for `span_s`, then handed to the engine for the
        recovery's record as (wall time, ms late, CPU ms the loop's thread ran meanwhile): close to the lateness,
        the loop was busy; far below, its thread waited for the interpreter (or the kernel)."""
        watch = LoopWatch(0.001, late_ms=2.0)
        try:
            await asyncio.wait_for(watch.run(), span_s)
        except TimeoutError:
            pass
        if self.link is not None:
            self.link.mark("loop_late", watch.recent())

    def phase_stats(self) -> dict[str, dict[str, float]]:
        """Where recent requests' first-token time went (ms, p50 / max per phase: `PHASES`), for /health."""
        out = {}
        for name in PHASES:
            vals = sorted(p[name] for p in self.phases if name in p)
            if vals:
                out[name] = {"n": len(vals), "p50": vals[len(vals) // 2], "max": vals[-1]}
        return out


# A request's way to its first token (ms each; perf_counter, one clock for the front and the engine): its head at
# the ASGI app -> the handler had its parsed body -> the engine took it off the link (submitted) -> taken in by the
# step thread -> first launched in a step -> first token handed to its sink -> first token line yielded for writing.
PHASES = ("to_handler", "to_submit", "queued", "to_scheduled", "to_token", "to_write")


def first_token_phases(marks: tuple[float, ...]) -> dict[str, float]:
    """`marks`: t_arrival, t_received, t_submit, t_intake, t_scheduled, t_first_token, t_written (0: not known)."""
    return {name: round((b - a) * 1000, 2) for name, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True) if a and b}


class Sink:
    """One request's output on the front's loop: the link delivers its items, its coroutine takes all that came
    since it last looked in one wake-up (`take`)."""

    def __init__(self) -> None:
        self._items: list[tuple[str, Any]] = []
        self._waiter: asyncio.Future[None] | None = None

    def deliver(self, item: tuple[str, Any]) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[tuple[str, Any]]:
        """Every item delivered since the last take (at least one)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


@dataclass(frozen=True)
class Running:
    """A request the front runs: its key on the link, its sink, and whether `/abort` may end it (one of a
    `/generate_many`'s: the router cannot close one request of a shared connection)."""

    key: int
    sink: Sink
    batched: bool = False


class FirstArrival:
    """Marks when the first POST came once the engine stood by or took over (its headers, before FastAPI reads and
    parses its body): a recovery's timeline tells the way to the engine from the engine's own parsing. A plain ASGI
    wrapper: nothing added to a streamed response's path."""

    def __init__(self, app: Any, state: EngineState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        state = self.state
        if scope["type"] == "http":  # every request's arrival (its `to_handler` phase): request.state.t_arrival
            scope.setdefault("state", {})["t_arrival"] = time.perf_counter()
        if state.first_arrival is None and scope["type"] == "http" and scope["method"] == "POST" \
                and state.state != "starting":
            state.first_arrival = time.perf_counter()
        await self.app(scope, receive, send)
