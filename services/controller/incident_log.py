"""`IncidentLog`: incident records in etcd (`incidents/<id>`), written with compare-and-swap.

Creation is a transaction (`create`: only if absent), which is what makes opening idempotent across
redeliveries and controllers. Every later write compares against the bytes this process last read or
wrote, so a controller that lost leadership cannot overwrite the progress of the one that replaced it.
"""

from __future__ import annotations

from libs.common.errors import Conflict
from libs.common.store import Store, encode_value
from services.controller.incident import IncidentRecord


def incident_key(incident_id: str) -> str:
    return f"incidents/{incident_id}"


class IncidentLog:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._last: dict[str, bytes] = {}  # id -> the bytes last seen in etcd (the CAS guard)

    async def create(self, rec: IncidentRecord) -> bool:
        raw = encode_value(rec)
        if await self.store.create(incident_key(rec.id), raw):
            self._last[rec.id] = raw
            return True
        return False

    async def load(self, incident_id: str) -> IncidentRecord | None:
        raw = await self.store.get(incident_key(incident_id))
        if raw is None:
            self._last.pop(incident_id, None)
            return None
        self._last[incident_id] = raw
        return IncidentRecord.model_validate_json(raw)

    async def save(self, rec: IncidentRecord) -> None:
        """Write `rec` if nobody changed the record since we read it; else raise `Conflict`."""
        raw = encode_value(rec)
        expected = self._last.get(rec.id)
        if expected is None:
            raise Conflict(f"incident {rec.id} was not loaded before saving")
        if not await self.store.cas(incident_key(rec.id), expected, raw):
            self._last.pop(rec.id, None)
            raise Conflict(f"incident {rec.id} changed under us (another controller?)")
        self._last[rec.id] = raw

    async def open_records(self) -> list[IncidentRecord]:
        out = []
        for raw in (await self.store.get_prefix("incidents/")).values():
            rec = IncidentRecord.model_validate_json(raw)
            if not rec.terminal:
                self._last[rec.id] = raw
                out.append(rec)
        return out

    def forget(self, incident_id: str) -> None:
        self._last.pop(incident_id, None)
