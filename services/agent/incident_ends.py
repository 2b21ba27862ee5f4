"""Failed active engines whose incident has ended: no takeover will come for their memory, so their slot is not
held for the rest of `takeover_wait_s` (an XID's incident fails at once while its GPU is unhealthy; before, the
model's new active engine waited the full 60 s).

The incident's record (`incidents/<id>`, the controller's, written before its end is announced) is read for each
engine still waiting for a takeover, every `period_s`: only while such an engine exists, one read each. Its id is
derived from the engine's id and generation (`libs.common.ids.incident_id`, as the controller opens it). An etcd
that does not answer changes nothing: the engine waits out `takeover_wait_s` as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Protocol

from libs.common.ids import incident_id
from libs.common.store import Store
from services.agent.engines import EngineRecord
from services.agent.supervision import awaits_takeover

log = logging.getLogger("holdfast.agent")
ENDED = frozenset({"resolved", "failed"})  # the controller's terminal incident states


class Host(Protocol):
    """What following incident ends needs of the agent: its engines' records, and an engine's replacement once no
    takeover will come for its memory."""

    def records(self) -> list[EngineRecord]: ...

    def memory_gone(self, rec: EngineRecord, why: str) -> None: ...


async def ended_state(store: Store, engine_id: str, generation: int) -> str | None:
    """The engine's incident's state if it has ended, else None (open, not opened, or unread)."""
    try:
        raw = await store.get(f"incidents/{incident_id('inc', engine_id, generation)}")
        state = json.loads(raw).get("state") if raw is not None else None
    except Exception as e:  # noqa: BLE001 - unknown: the engine keeps waiting for a takeover
        log.debug("incident of %s unread: %s", engine_id, e)
        return None
    return state if state in ENDED else None


async def follow_incident_ends(host: Host, store: Store, period_s: float, takeover_wait_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        now = time.monotonic()
        for rec in [r for r in host.records() if awaits_takeover(r, now, takeover_wait_s)]:
            state = await ended_state(store, rec.engine_id, rec.generation)
            if state is not None:
                host.memory_gone(rec, f"its incident ended {state}")
