"""`IncidentLog`: incident records in etcd (`incidents/<id>`), written through a fenced `BatchWriter`.

Creation is awaited and conditional (`create`: only if absent), which is what makes opening idempotent
across redeliveries and controllers. Later states are written behind (`save` returns at once; DESIGN.md
section 4): the action of a step is done before its record is queued, so a crash that loses a queued
record only makes the next leader redo an idempotent action. Every write is fenced by the leader key
(the writer's guard): a controller that lost leadership cannot overwrite the progress of the one that
replaced it; its writer's `lost` is set and it stops.

That ends are published is recorded per batch, in a ledger (`announced/<ledger id>`, announced_ends.py), not in
each record: an ended record is written once.
"""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

from libs.common.cluster_view import range_pages
from libs.common.etcd_batch import BatchWriter
from libs.common.ids import new_id
from libs.common.store import Store
from services.controller.announced_ends import AnnouncedEnds, Ledger
from services.controller.incident import IncidentRecord


def incident_key(incident_id: str) -> str:
    return f"incidents/{incident_id}"


def ledger_key(ledger_id: str) -> str:
    return f"announced/{ledger_id}"


class TakeOver(NamedTuple):
    """What a new leader takes over: the open records, the ended ones whose end no ledger names (nor an earlier
    version's unmarked record says announced), and the ledgers left naming no record (to delete)."""

    open: list[IncidentRecord]
    unannounced: list[IncidentRecord]
    spent_ledgers: list[str]


class IncidentLog:
    def __init__(self, store: Store, writer: BatchWriter | None = None) -> None:
        self.store = store
        self.writer = writer or BatchWriter(store)

    async def create(self, rec: IncidentRecord) -> bool:
        return await self.writer.create(incident_key(rec.id), rec)

    def create_soon(self, rec: IncidentRecord) -> asyncio.Future[bool]:
        """`create`, queued now and awaited later (a batch of openings)."""
        return self.writer.create_soon(incident_key(rec.id), rec)

    async def load(self, incident_id: str) -> IncidentRecord | None:
        """The latest record: this process's own write not yet in etcd first, else etcd's."""
        queued, raw = self.writer.pending(incident_key(incident_id))
        if not queued:
            raw = await self.store.get(incident_key(incident_id))
        return None if raw is None else IncidentRecord.model_validate_json(raw)

    def save(self, rec: IncidentRecord) -> None:
        """Queue `rec` (written behind, fenced)."""
        self.writer.put_nowait(incident_key(rec.id), rec)

    def write_soon(self, rec: IncidentRecord) -> asyncio.Future[bool]:
        """Queue `rec` now (fenced, hastened) and return the write's confirmation, to be awaited later (a future:
        no task for each closing incident)."""
        return self.writer.put_soon(incident_key(rec.id), rec)

    def announced(self, recs: list[IncidentRecord]) -> None:
        """The ends of `recs` are published: one ledger naming them all, written behind (fenced)."""
        self.writer.put_nowait(ledger_key(new_id()), Ledger(incidents=[rec.id for rec in recs]))

    def save_after(self, rec: IncidentRecord, delay_s: float) -> None:
        """Queue `rec` in `delay_s` unless a newer record of the incident is saved first (then `rec` never is)."""
        self.writer.put_after(incident_key(rec.id), rec, delay_s)

    async def in_etcd(self, incident_id: str) -> IncidentRecord | None:
        """The record etcd holds, never this process's queued write (what a write whose outcome is unknown left)."""
        raw = await self.store.get(incident_key(incident_id))
        return None if raw is None else IncidentRecord.model_validate_json(raw)

    async def to_take_over(self) -> TakeOver:
        """Read once the term's fence holds: no earlier leader writes a record or a ledger any more."""
        ledgers, _ = await range_pages(self.store, "announced/")
        items, _ = await range_pages(self.store, "incidents/")  # paged: thousands of records exceed 4 MiB
        announced = AnnouncedEnds()
        for key, raw in ledgers:
            announced.add(key.removeprefix("announced/"), Ledger.model_validate_json(raw).incidents, 0.0)
        open_, unannounced, ids = [], [], set()
        for key, raw in items:
            rec = IncidentRecord.model_validate_json(raw)
            ids.add(key.removeprefix("incidents/"))
            if not rec.terminal:
                open_.append(rec)
            elif rec.end_unannounced and rec.id not in announced:
                unannounced.append(rec)
        announced.sweep(ids, time.time())
        return TakeOver(open_, unannounced, list(announced.spent))
