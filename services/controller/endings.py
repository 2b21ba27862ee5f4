"""`IncidentEnds`: an incident's end is recorded, then announced, and announced once, whatever its writes do.

An end (resolved, failed) is announced (`incident.resolved` / `incident.failed`) only once its record is in etcd:
a leader that lost its term in between would have announced an end that the next leader, resuming from the older
record, cannot see, and might finish the other way (incident.py, invariant 2). The converse holds too: every end
in etcd is announced. A write can fail at the client and still land (its answer lost or late: a timeout), and a
publication can fail after the record is in; so an ended record carries `end_unannounced` from the transition that
ends it, and once its end is published a ledger naming it is written behind (one per batch of ends published:
announced_ends.py; the record itself is never written again). An end is unannounced while it is marked and no
ledger names it:
- `announce`: each end's write awaited, the ends written published together, their ledger written. An end whose
  write failed, or whose publication did, becomes a doubt (its message is redelivered as before);
- `settle`: a doubt read back from etcd, itself (not this process's queued write), once etcd answers: ended and
  marked -> announced (a doubt is never in a ledger: none was written for it); ended and not marked (an earlier
  version's announced record) -> nothing; not ended (the write did not land) -> handed back to be
  resumed from that record; gone -> nothing (retention never offers a marked record: view.py). The leader's
  deadline pass settles the doubts on every tick while there are any: the first tick after a store error clears;
- `take_over`: a new leader announces every ended record still unannounced before it consumes anything (what a
  term that ended between the write and the announcement left).
Every end event's id is derived from its incident (routes.py, `ended`), so one published twice (a leader gone
between the publication and its ledger's write) is dropped by JetStream's duplicate window.
"""

from __future__ import annotations

import asyncio
import logging

from libs.common.bus import Bus
from services.controller.engine_stops import EngineStops
from services.controller.incident import IncidentRecord
from services.controller.incident_log import IncidentLog
from services.controller.routes import IncidentEvents

log = logging.getLogger("holdfast.controller.endings")


class IncidentEnds:
    def __init__(self, bus: Bus, log_: IncidentLog, events: IncidentEvents, stops: EngineStops) -> None:
        self.bus = bus
        self.log = log_
        self.events = events
        self.stops = stops  # a failed incident's engine that serves on gets its memory thawed
        # Ended here, not known announced: its record's write failed at the client (it may have landed), or its
        # publication failed. By id: the ended record.
        self.doubts: dict[str, IncidentRecord] = {}

    async def announce(self, ends: list[tuple[int, IncidentRecord, asyncio.Future[bool]]],
                       out: list[BaseException | None]) -> None:
        """Publish each end (`ends`: its message, its ended record, that record's write) once its write is
        confirmed; `out[at]` is what failed an end's write (its message is redelivered)."""
        written = []
        for at, rec, write in ends:
            try:
                await write
                written.append(rec)
            except Exception as e:  # noqa: BLE001 - maybe written anyway: read back by `settle`
                log.warning("incident %s: its end's record write failed (%s): announced once etcd shows it", rec.id, e)
                self.doubts[rec.id] = rec
                out[at] = e
        await self._publish(written)

    async def take_over(self, recs: list[IncidentRecord]) -> None:
        """A new leader's start: the ended records (in etcd) whose end was never announced."""
        if recs:
            log.info("announcing %d incident end(s) recorded by an earlier term", len(recs))
        await self._publish(recs)

    async def settle(self, inc_id: str) -> IncidentRecord | None:
        """One doubt, read back from etcd (raises while etcd does not answer: kept for the next pass). Returns its
        record when it has not ended there: the end never landed, the incident goes on from that record."""
        rec = await self.log.in_etcd(inc_id)
        self.doubts.pop(inc_id, None)
        if rec is None or (rec.terminal and not rec.end_unannounced):
            return None  # deleted by retention after an announcement, or announced (a redelivery ended it again)
        if not rec.terminal:
            log.warning("incident %s: its end was not recorded after all: resumed from its record (%s)", inc_id,
                        rec.state)
            return rec
        await self._publish([rec])
        return None

    async def _publish(self, recs: list[IncidentRecord]) -> None:
        """The end events of ended records that are in etcd, then their ledger (written behind)."""
        if not recs:
            return
        self.events.route_back(recs)
        try:
            await self.bus.publish_all([e for rec in recs for e in self.events.ended(rec)])
        except Exception as e:  # noqa: BLE001 - recorded: announced by a later pass (or the next leader)
            log.warning("%d incident end(s) recorded but not announced (%s): again on the next pass", len(recs), e)
            for rec in recs:
                self.doubts[rec.id] = rec
            return
        for rec in recs:
            self.doubts.pop(rec.id, None)
            if rec.serves_on:
                self.stops.thaw(rec.id, rec.node)
        self.events.unmark(recs)
        self.log.announced(recs)
