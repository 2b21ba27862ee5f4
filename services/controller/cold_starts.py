"""The fallback's cold-started successor, seen from the controller (a part of `IncidentDriver`).

A cold-started successor is routed in when it reports ready (`engine.ready`, or `engines/<id>` state ready),
not when the spawn is answered; a reattach that succeeds after the cold start began wins (the memory is
there, nothing reloads) and the cold engine is stopped. Engines no longer needed (a superseded cold engine,
a drained node's engine once its successor serves) are stopped in the background, best effort.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from libs.common.events import IntentResult, StopEngine, StopReply
from services.controller.incident import IncidentRecord, IncidentState, Trigger, apply

if TYPE_CHECKING:
    from services.controller.pipeline import IncidentDriver

log = logging.getLogger("holdfast.controller.pipeline")
S = IncidentState


class ColdStarts:
    """Mixed into `IncidentDriver`: uses its records, locks, commit and advance."""

    async def _cold_spawned(self: IncidentDriver, r: IntentResult) -> None:
        """The fallback's engine was started: remember it; route it in once it is ready (or stop it if a
        late reattach already won)."""
        inc_id = r.incident_id
        async with self._lock(inc_id):
            rec = self.open.get(inc_id) or await self.log.load(inc_id)
            if rec is None or not r.successor_id:
                return
            if rec.state is not S.FALLBACK:
                if rec.successor_id != r.successor_id and not rec.cold_stopped:
                    # The reattach won before the spawn was even answered: this engine is not needed.
                    self._stop_cold(rec.model_copy(update={"cold_successor_id": r.successor_id,
                                                           "cold_successor_node": r.node}))
                return
            if rec.cold_successor_id != r.successor_id:
                new = rec.model_copy(update={"cold_successor_id": r.successor_id, "cold_successor_endpoint": r.endpoint,
                                             "cold_successor_node": r.node, "updated_at": time.time()})
                rec = await self._commit(rec, new)
            self.by_cold[r.successor_id] = inc_id
        engine = self.view.engines.get(r.successor_id)
        if engine is not None and engine.state == "ready":  # it was ready before the spawn was answered
            await self._cold_ready(inc_id, r.successor_id, engine.endpoint)

    async def _cold_ready(self: IncidentDriver, inc_id: str, engine_id: str, endpoint: str | None) -> None:
        async with self._lock(inc_id):
            rec = self.open.get(inc_id)
            if rec is None or rec.state is not S.FALLBACK or rec.cold_successor_id != engine_id:
                return
            new = apply(rec, Trigger.SPAWNED, time.time(), self.deadlines, successor_id=engine_id,
                        successor_endpoint=endpoint or rec.cold_successor_endpoint)
            self.by_cold.pop(engine_id, None)
            rec = await self._commit(rec, new)
            await self._advance(rec)

    def _stop_cold(self: IncidentDriver, rec: IncidentRecord) -> None:
        """Stop a superseded cold-started engine (best effort, in the background; the node may be gone)."""
        engine_id, node = rec.cold_successor_id, rec.cold_successor_node
        if not engine_id:
            return
        self.by_cold.pop(engine_id, None)
        self._stop_in_background(rec.id, engine_id, node)

    def _stop_in_background(self: IncidentDriver, inc_id: str, engine_id: str, node: str | None) -> None:
        """Stop an engine that is no longer needed (best effort, in the background; the node may be gone)."""
        engine = self.view.engines.get(engine_id)
        node = node or (engine.node if engine else None)
        if not node:
            log.warning("incident %s: cannot stop engine %s: node unknown", inc_id, engine_id)
            return

        async def stop() -> None:
            try:
                await self.bus.request(node, StopEngine(engine_id=engine_id), StopReply, timeout=10.0)
                log.info("incident %s: stopped engine %s on %s", inc_id, engine_id, node)
            except Exception as e:  # noqa: BLE001 - best effort: a leftover engine is visible in the view
                log.warning("incident %s: could not stop engine %s: %s", inc_id, engine_id, e)

        task = asyncio.create_task(stop(), name=f"stop:{engine_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
