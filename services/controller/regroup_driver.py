"""The leader's regroup pass: a degraded engine is made a whole group again once its GPUs are back.

A tensor-parallel group that lost a GPU is continued by fewer ranks (one engine, or a smaller group) from its
ranks' KV backups (docs/multi_gpu.md part 6). Once its node has as many healthy GPUs as the spec has ranks again
(`operations.regroup_refusal` finds nothing against it), and has had them for `regroup_after_s` (a GPU that flaps
is not trusted at once), a `regroup` incident is started, as the operator's `POST /v1/engines/{id}/regroup` starts
one: the dc_manager places a whole group there and the group continues every sequence from the engine's KV backups.
The streams pause for the group's start (its ranks load their shards cold); none is lost. Off unless
`regroup_after_s` > 0 (that pause is the stall degraded serving avoids: an operator picks its moment).

Level-triggered like the roll-out pass: each tick looks at the view afresh; the incident id is the engine's and
generation's, so a leader that dies after starting one never starts a second (`start_on_purpose` is a create).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from libs.common.errors import Conflict, NotFound
from libs.common.events import EngineRole, IncidentReason
from libs.common.store import Store
from services.controller.operations import regroup_refusal, start_on_purpose
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.regroup")
TICK_S = 1.0  # a GPU healed is no emergency: the view is looked at once a second, not at the deadline pass's pace


def due(regroupable: Iterable[str], since: dict[str, float], now: float, after_s: float) -> list[str]:
    """The engines to regroup now: those regroupable for `after_s` without a break (pure; `since` is updated: the
    first tick each was seen regroupable, forgotten when it is not)."""
    now_ok = set(regroupable)
    for engine_id in [e for e in since if e not in now_ok]:
        del since[engine_id]
    for engine_id in now_ok:
        since.setdefault(engine_id, now)
    return sorted(e for e in now_ok if now - since[e] >= after_s)


class RegroupDriver:
    def __init__(self, store: Store, view: ClusterView, after_s: float, tick_s: float = TICK_S) -> None:
        self.store = store
        self.view = view
        self.tick_s = tick_s
        self.after_s = after_s
        self.since: dict[str, float] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick(time.time())
            except Exception:  # noqa: BLE001 - one bad pass must not end the leader's term
                log.exception("regroup pass failed (retried next tick)")

    def candidates(self) -> list[str]:
        """Serving engines in no incident that a regroup would take (the view as it is)."""
        return [e.engine_id for e in self.view.engines.values()
                if e.role is EngineRole.ACTIVE and e.state == "ready"
                and self.view.open_incident_for(e.engine_id) is None and regroup_refusal(self.view, e.engine_id) is None]

    async def tick(self, now: float) -> None:
        for engine_id in due(self.candidates(), self.since, now, self.after_s):
            self.since.pop(engine_id, None)
            try:
                rec = await start_on_purpose(self.store, self.view, engine_id, IncidentReason.REGROUP)
            except (Conflict, NotFound) as e:  # busy or gone since the view said otherwise, or started already
                log.info("%s not regrouped now: %s", engine_id, e)
                continue
            log.info("%s regroupable for %.0f s: regroup incident %s", engine_id, self.after_s, rec.id)
