"""`EngineStops`: engines an incident no longer needs, stopped in the background, best effort.

Two kinds: a fallback's cold-started engine superseded by a late reattach (the reattach holds the memory,
nothing reloads), and a drained node's engine once its successor serves. The node may be gone; a leftover
engine stays visible in the view. Each stop is a named task kept referenced until it ends; `cancel` ends
those still running when the leader steps down.

And the converse: an engine that serves on after its incident (begun on purpose) failed gets its memory back,
frozen for that incident (gpu_manager `thaw`), the same way. Best effort too: a lease left frozen is visible in
the view and is reclaimed at its deadline (the engine keeps its mapping, but the table counts that memory free).

Each stop carries the term of the driver that sends it (`StopEngine.term`): a driver that outlived its term (a pause
between its leader check and the request) sends its own, ended one, and the agent refuses it (`stale_term`,
libs/common/terms.py) rather than stop an engine the new leader may still want.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from libs.common.bus import Bus
from libs.common.events import StopEngine, StopReply, Thaw, ThawReply
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.pipeline")


class EngineStops:
    def __init__(self, bus: Bus, view: ClusterView, *, term: int = 0) -> None:
        self.bus = bus
        self.view = view
        self.term = term  # the leader term the stops are stamped with (StopEngine.term)
        self.tasks: set[asyncio.Task[None]] = set()

    def stop(self, inc_id: str, engine_id: str | None, node: str | None) -> None:
        """Stop `engine_id` on `node` (else the node the view places it on), in the background."""
        if not engine_id:
            return
        engine = self.view.engines.get(engine_id)
        node = node or (engine.node if engine else None)
        if not node:
            log.warning("incident %s: cannot stop engine %s: node unknown", inc_id, engine_id)
            return
        self._background(self._stop(inc_id, engine_id, node), f"stop:{engine_id}")

    def thaw(self, inc_id: str, node: str | None) -> None:
        """The leases frozen for `inc_id` on `node` back to their owners, in the background."""
        if node:
            self._background(self._thaw(inc_id, node), f"thaw:{inc_id}")

    def _background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _stop(self, inc_id: str, engine_id: str, node: str) -> None:
        try:
            await self.bus.request(node, StopEngine(engine_id=engine_id, term=self.term), StopReply, timeout=10.0)
            log.info("incident %s: stopped engine %s on %s", inc_id, engine_id, node)
        except Exception as e:  # noqa: BLE001 - best effort: a leftover engine is visible in the view
            log.warning("incident %s: could not stop engine %s: %s", inc_id, engine_id, e)

    async def _thaw(self, inc_id: str, node: str) -> None:
        try:
            reply = await self.bus.request(node, Thaw(incident_id=inc_id), ThawReply, timeout=10.0)
            if reply.lease_ids:
                log.info("incident %s: %d lease(s) on %s thawed, their engine serves on", inc_id,
                         len(reply.lease_ids), node)
        except Exception as e:  # noqa: BLE001 - best effort: visible in the view, reclaimed at its deadline
            log.warning("incident %s: the leases frozen for it on %s were not thawed: %s", inc_id, node, e)

    def cancel(self) -> None:
        for task in list(self.tasks):
            task.cancel()
