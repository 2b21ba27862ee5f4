"""Events delivered together, handled together (a part of `IncidentDriver`).

The controller's durable consumers of faults and intent results hand it what arrived in one loop pass
(`Bus.durable_batches`). New incidents are opened together (their creates awaited together, their route-out
events published together, one wait for their stream acks) and prompt takeovers' results are routed in
together; one task for the batch instead of one per message. Each incident still takes its own lock, its
own record and its own derived event ids, so what a crash leaves is what the one-at-a-time path leaves:
the record says which step is done, and a redelivered message redoes an idempotent step. Anything out of
the common case (a redelivery that finds its record, an engine already in an incident, a result that is
not a prompt takeover's) takes the one-at-a-time handler, in the same batch. A failure fails (and
redelivers) only the messages it concerns; the per-message result is what the consumer acks or naks.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from libs.common.bus import Wired, beside, holding
from libs.common.events import EngineRole, Envelope, FaultDetected, IntentResult, Step
from services.controller.incident import IncidentRecord, IncidentState, Trigger, apply, incident_id_for

if TYPE_CHECKING:
    from services.controller.pipeline import IncidentDriver, RouteOut

log = logging.getLogger("holdfast.controller.pipeline")
S = IncidentState


class Batches:
    """Mixed into `IncidentDriver`: uses its records, locks, writer, commit and route-in/out halves."""

    async def on_faults(self: IncidentDriver, envs: list[Envelope]) -> list[BaseException | None]:
        """Faults delivered in one loop pass. A new incident (the common case: not open here, no other incident
        of its engine, not ended here, once in the batch) is opened and routed out with the others; anything else takes
        `on_fault`'s path on its own. Per fault, in order: None, or the exception that failed it."""
        out: list[BaseException | None] = [None] * len(envs)
        fresh: list[tuple[int, IncidentRecord]] = []
        alone: list[int] = []
        ids: set[str] = set()
        for i, env in enumerate(envs):
            f = env.data
            if not isinstance(f, FaultDetected):
                alone.append(i)
                continue
            if f.role is EngineRole.STANDBY:
                continue  # a standby holds no leased memory; the agent replaces it on its own
            inc_id = incident_id_for(f.engine_id, f.generation)
            if (inc_id in ids or inc_id in self.open or inc_id in self._locks or inc_id in self._closed
                    or self.view.open_incident_for(f.engine_id)):
                alone.append(i)
                continue
            ids.add(inc_id)
            try:
                fresh.append((i, self._record_from_fault(inc_id, f, env)))
            except Exception as e:  # noqa: BLE001 - this fault alone is redelivered
                out[i] = e
        return await beside(self._open_together(fresh, out), {i: self.on_fault(envs[i]) for i in alone}, out)

    async def _open_together(self: IncidentDriver, fresh: list[tuple[int, IncidentRecord]], out: list[BaseException | None]) -> None:
        """`on_fault` for new incidents, each under its own lock: their creates awaited together, their route-out
        events published together; a failure fails (and redelivers) only the faults it concerns."""
        async with holding([self._lock(rec.id) for _, rec in fresh]):  # new ids: nobody else holds them
            created = [(i, rec, self.log.create_soon(rec)) for i, rec in fresh]
            opened: list[tuple[int, IncidentRecord]] = []
            for i, rec, fut in created:
                try:
                    first = await fut
                except Exception as e:  # noqa: BLE001 - etcd failed this create: redelivered
                    out[i] = e
                    continue
                if not first:  # it exists (a redelivery raced in): load it and go on alone
                    try:
                        await self._resume_unlocked(rec.id)
                    except Exception as e:  # noqa: BLE001 - redelivered
                        out[i] = e
                    continue
                self.metrics.record_opened(rec)
                if self.tracing.export_spans:
                    self.tracing.steps(rec.model_copy(update={"steps": {}}), rec)
                log.info("incident %s opened: %s %s", rec.id, rec.engine_id, rec.kind)
                self.open[rec.id] = rec
                opened.append((i, rec))
            routed: list[tuple[int, IncidentRecord, RouteOut]] = []
            for i, rec in opened:
                try:
                    routed.append((i, rec, self._route_out(rec)))
                except Exception as e:  # noqa: BLE001 - redelivered (its record says opened)
                    out[i] = e
            try:
                await self.bus.publish_all([ev for _, _, r in routed for ev in r.events])
            except Exception as e:  # noqa: BLE001 - none of them is routed out: all redelivered (idempotent)
                for i, _, _ in routed:
                    out[i] = e
                return
            for i, rec, r in routed:
                try:
                    await self._advance(await self._commit(rec, self._routed_out(r),
                                                           after_s=self.settings.waiting_record_delay_s))
                except Exception as e:  # noqa: BLE001 - redelivered
                    out[i] = e

    async def on_results(self: IncidentDriver, envs: list[Envelope]) -> list[BaseException | None]:
        """Intent results delivered in one loop pass. A prompt takeover's result (reattached, for an incident open
        here and reattaching, or freezing with the freeze's end in the result; no successor early; once in the
        batch) is routed in with the others; anything else takes `on_intent_result`'s path on its own. Per
        result, in order: None or its failure."""
        out: list[BaseException | None] = [None] * len(envs)
        together: list[tuple[int, IntentResult]] = []
        alone: list[int] = []
        ids: set[str] = set()
        for i, env in enumerate(envs):
            r = env.data
            if not isinstance(r, IntentResult) or not self._routes_in_at_once(r, ids):
                alone.append(i)
                continue
            ids.add(r.incident_id)
            together.append((i, r))
        return await beside(self._route_in_together(together, out), {i: self.on_intent_result(envs[i]) for i in alone},
                             out)

    def _routes_in_at_once(self: IncidentDriver, r: IntentResult, ids: set[str]) -> bool:
        rec = self.open.get(r.incident_id)
        lock = self._locks.get(r.incident_id)
        return (r.step is Step.REATTACH and r.ok and bool(r.successor_id) and rec is not None
                and (rec.state is S.REATTACHING or (rec.state is S.FREEZING and r.frozen_at is not None))
                and r.incident_id not in ids
                and r.incident_id not in self._reattached_early and (lock is None or not lock.locked()))

    async def _route_in_together(self: IncidentDriver, together: list[tuple[int, IntentResult]], out: list[BaseException | None]) -> None:
        """`trigger(REATTACHED)` then route-in for each result, each under its incident's lock (none is held: checked
        in this loop pass), their events published together; a failure fails only the results it concerns."""
        async with holding([self._lock(r.incident_id) for _, r in together]):
            staged: list[tuple[int, IncidentRecord, IncidentRecord, list[Wired]]] = []
            for i, r in together:
                try:
                    rec = self.open[r.incident_id]
                    cur = self._frozen_at(rec, r.frozen_at) if r.frozen_at is not None and rec.state is S.FREEZING else rec
                    new = apply(cur, Trigger.REATTACHED, time.time(), self.deadlines, detail=r.detail,
                                successor_id=r.successor_id, successor_endpoint=r.endpoint)
                    routing = await self._commit(rec, new, write=False)  # as trigger: route-in follows at once
                    staged.append((i, routing, *self._route_in_events(routing)))
                except Exception as e:  # noqa: BLE001 - redelivered
                    out[i] = e
            try:
                await self.bus.publish_all([ev for _, _, _, events in staged for ev in events])
            except Exception as e:  # noqa: BLE001 - none routed in: each redelivered, its record kept as it stands
                for i, routing, _, _ in staged:
                    self.log.save(routing)
                    out[i] = e
                return
            for i, routing, routed, _ in staged:
                try:
                    await self._routed_in(routing, routed)
                except Exception as e:  # noqa: BLE001 - redelivered
                    out[i] = e
