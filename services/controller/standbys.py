"""`StandbyAnnouncer`: routers are told each routed engine's shadowing standby (`router.endpoint.standby`), so that
they keep spare connections open to it before any failure (services/router/spare.py).

Why: at a failover every router worker's requests for the successor (the resumed streams' batch, the requests sent
during the outage) missed on an engine it had never connected to, and each connected then, in the loop pass that
sent the replays; under cProfile on the CPU machine that connection churn was ~16 ms of a router's CPU a failover
(docs/results/router-spares-2026-12-05/). The successor is most often the standby that shadows the failed engine
(the route-out names it: `EndpointRemoved.successor_url`), which is known long before.

Rules: `announcements` (pure) is what the view says now: each engine with an endpoint and a standby that shadows it
on its node. The leader sends what changed since its last pass, and everything every `refresh_s` (a router that
started or reconnected meanwhile learns it; routers forget a standby not sent again within their own bound). Best
effort: a lost announcement costs only the spares it would have opened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from libs.common.bus import Bus
from libs.common.events import EndpointStandby
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.standbys")

Key = tuple[str, str]  # (model, engine id)


def announcements(view: ClusterView) -> dict[Key, tuple[str, str]]:
    """(model, engine) -> (its standby's id, url), for every routed engine a standby on its node shadows."""
    out: dict[Key, tuple[str, str]] = {}
    for engine_id in view.shadowed_by:  # the shadowed engines only: a pass costs nothing where none is shadowed
        info, routed = view.engines.get(engine_id), view.endpoint_of(engine_id)
        if info is None or routed is None:
            continue
        standby = view.shadow_of(engine_id, info.node)
        if standby is not None and standby.endpoint:
            out[(routed[0], engine_id)] = (standby.engine_id, standby.endpoint)
    return out


class StandbyAnnouncer:
    def __init__(self, bus: Bus, view: ClusterView, period_s: float, refresh_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bus, self.view = bus, view
        self.period_s, self.refresh_s = period_s, refresh_s
        self.clock = clock
        self.sent: dict[Key, tuple[str, str]] = {}
        self._refreshed = float("-inf")
        self.announced = 0  # events sent

    async def once(self) -> None:
        now = self.clock()
        current = announcements(self.view)
        refresh = now - self._refreshed >= self.refresh_s
        due = current if refresh else {k: v for k, v in current.items() if self.sent.get(k) != v}
        if due:
            await self.bus.publish_all([self.bus.envelope(EndpointStandby(
                model=model, engine_id=engine_id, standby_id=sid, standby_url=url))
                for (model, engine_id), (sid, url) in due.items()])
            self.announced += len(due)
        if refresh:
            self._refreshed = now
        self.sent = current

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except Exception as e:  # noqa: BLE001 - best effort: the next pass sends it again
                log.warning("standby announcements not sent: %r", e)
                self.sent = {}
            await asyncio.sleep(self.period_s)
