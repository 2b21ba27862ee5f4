"""The leader's roll-out pass: advances every running `rollouts/<class>` record (see `rollout.py`).

Level-triggered, like the deadline pass: each tick reads the running roll-outs from the view, decides with
`rollout.advance`, creates the next `hot_upgrade` incident (which the incident pipeline then drives), and
writes the record with a compare-and-swap on its etcd revision, so a record changed by anyone else (a new
roll-out, another leader) is re-read on the next tick rather than overwritten.
"""

from __future__ import annotations

import asyncio
import logging
import time

from libs.common.errors import Conflict, NotFound
from libs.common.events import IncidentReason
from libs.common.store import Store
from services.controller import rollout
from services.controller.operations import start_on_purpose
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.rollout")


class RolloutDriver:
    def __init__(self, store: Store, view: ClusterView, tick_s: float) -> None:
        self.store = store
        self.view = view
        self.tick_s = max(tick_s, 0.1)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            for rec in list(self.view.rollouts.values()):
                if rec.state is rollout.RolloutState.RUNNING:
                    try:
                        await self.step(rec.engine_class)
                    except Exception:  # noqa: BLE001 - one roll-out's trouble must not stop the others
                        log.exception("roll-out of %s: pass failed (retried next tick)", rec.engine_class)

    async def step(self, engine_class: str) -> None:
        key = rollout.rollout_key(engine_class)
        raw, revision = await self.store.get_with_revision(key)
        if raw is None:
            return
        rec = rollout.RolloutRecord.model_validate_json(raw)
        d = rollout.advance(rec, self.view.engines, self.view.incidents, self.view.open_by_engine, time.time())
        new = d.record
        if d.start is not None:
            try:
                await start_on_purpose(self.store, self.view, d.start.engine_id, IncidentReason.HOT_UPGRADE,
                                       version=rec.version)
            except (Conflict, NotFound) as e:
                # Gone or busy since the view said otherwise (or the incident exists: adopted next pass).
                log.info("roll-out of %s: %s not started yet: %s", engine_class, d.start.engine_id, e)
                if not d.changed:
                    return
            else:
                new = rollout.with_started(new, d.start, time.time())
                log.info("roll-out of %s to %s: upgrading %s", engine_class, rec.version, d.start.engine_id)
        elif not d.changed:
            return
        if not await self.store.cas_revision(key, revision, new):
            log.info("roll-out of %s changed under us; re-read next tick", engine_class)
        elif new.state is not rollout.RolloutState.RUNNING:
            log.info("roll-out of %s to %s: %s %s", engine_class, rec.version, new.state.value, new.failure or "")
