"""`Intake`: the ASGI layer that takes a burst of new requests a slice per pass of the event loop, so that what else
runs on the loop (the streams in flight: each one's next lines) has its turn between the slices, not after the
whole burst.

Why: a burst of requests that arrive together (many connections made ready by one poll) each start a task in the
same pass, and each task runs to its answer without waiting for anything (its body is there, a refusal needs no
engine): 500 requests too long for the model, ~0.3-0.5 ms each in the batched engine's front, ran back to back, and
every stream's next line waited behind all of them (a largest gap of 0.2-0.9 s against ~30 ms without the burst,
tiny model on the CPU machine). Here a new request goes in at once while its pass has used less than `budget_s` on
new requests; past it, it waits, in arrival order, for a later pass. Each pass wakes as many waiters as recent
passes fitted in the budget (doubled while they stay within it, halved when one does not), and the woken go in
without looking again.

Health probes (`exempt` paths) go straight in: each is one cheap answer, not a burst's work, and one that waited
behind a burst of a thousand requests answered a router's liveness probe 20 s late (probe of 2026-12-07), long
enough for an orchestrator to restart a router that was busy but working.

Invariants: requests go in in the order they arrived (a new one waits while any waits); a waiter is woken by a
later pass, never lost (each admission schedules the next pass's look while any waits; a woken waiter cancelled
before it ran hands its turn on). Nothing is added to a request once it is in: its body, its response and its
stream are the app's as before.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
App = Callable[[Scope, Any, Any], Awaitable[None]]


class Intake:
    def __init__(self, app: App, *, budget_s: float = 0.002, max_wake: int = 64,
                 exempt: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.exempt = exempt  # paths that never wait (health probes)
        self.budget_s = budget_s
        self.max_wake = max_wake
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._opened: float | None = None  # perf_counter of this pass's first admission
        self._look_scheduled = False
        self._wake = 1  # waiters woken a pass
        self.deferred = 0  # requests that waited for a later pass (health, tests)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") not in self.exempt:
            if self._waiting or not self._room():
                await self._wait()
            self._admit()
        await self.app(scope, receive, send)

    def stats(self) -> dict[str, Any]:
        return {"deferred": self.deferred, "waiting": len(self._waiting), "wake": self._wake}

    def _room(self) -> bool:
        return self._opened is None or time.perf_counter() - self._opened < self.budget_s

    def _admit(self) -> None:
        if self._opened is None:
            self._opened = time.perf_counter()
            self._schedule_look()

    def _schedule_look(self) -> None:
        if not self._look_scheduled:
            self._look_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_pass)

    async def _wait(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self.deferred += 1
        self._schedule_look()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # woken, then cancelled before it ran: its turn goes on
                self._schedule_look()
            else:
                self._waiting.remove(fut)
            raise

    def _next_pass(self) -> None:
        """A pass after some went in (call_soon: the callbacks of that pass ran before this): how long it took sets
        how many waiters this one wakes; they run in the next pass."""
        self._look_scheduled = False
        if self._opened is not None:
            took = time.perf_counter() - self._opened
            self._wake = max(1, self._wake // 2) if took > self.budget_s else min(self.max_wake, self._wake * 2)
            self._opened = None
        woken = 0
        while self._waiting and woken < self._wake:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                woken += 1
        if self._waiting:
            self._schedule_look()
