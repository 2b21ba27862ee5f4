"""The route-in's own timeline: for each endpoint added by an event, when the event was published, when this
router received it, and when it sent that endpoint its first request and got the first answer (wall clock,
like every event's time, so the four line up with a takeover's events).

Why: after a takeover, the hop from `router.endpoint.added` to the successor's handler took 7.5-10 ms on an
H200 (2026-11-30; a fifth of a 16 GiB recovery), and no event shows where: in the event's delivery, in
this router, or in the engine. `GET /stats` lists the recent ones (`route_ins`); `holdfast bench recovery`
puts them on its timeline.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class RouteIns:
    def __init__(self, keep: int = 32, *, clock: Callable[[], float] = time.time) -> None:
        self.keep = keep
        self.clock = clock
        self._by_engine: OrderedDict[str, dict[str, float]] = OrderedDict()

    def added(self, engine_id: str, published: float | None) -> None:
        """An event added `engine_id` (published at `published`, its envelope's time; None: not by an event). After
        its promise (below) the entry goes on: its first request may have gone before it was added."""
        now = self.clock()
        entry = self._by_engine.pop(engine_id, None)
        entry = entry if entry is not None and "promised" in entry and "published" not in entry else {}
        self._by_engine[engine_id] = {**entry, "published": now if published is None else published, "received": now}
        self._trim()

    def promised(self, engine_id: str, published: float | None) -> None:
        """An endpoint.removed event named `engine_id` its likely successor (sync.py `_promise`)."""
        now = self.clock()
        self._by_engine.pop(engine_id, None)
        self._by_engine[engine_id] = {"promised_published": now if published is None else published, "promised": now}
        self._trim()

    def _trim(self) -> None:
        while len(self._by_engine) > self.keep:
            self._by_engine.popitem(last=False)

    def _first(self, engine_id: str, key: str) -> None:
        entry = self._by_engine.get(engine_id)
        if entry is not None and key not in entry:
            entry[key] = self.clock()

    def sent(self, engine_id: str) -> None:
        """A request is on its way to `engine_id` (only the first one since it was added counts)."""
        self._first(engine_id, "first_sent")

    def answered(self, engine_id: str) -> None:
        """`engine_id` answered a request's headers (the first time since it was added counts)."""
        self._first(engine_id, "first_answered")

    def recent(self) -> list[dict[str, float | str]]:
        return [{"engine_id": engine_id, **times} for engine_id, times in self._by_engine.items()]
