"""`EngineRoutes`: the routes of engines that are in no incident: a ready active engine's endpoint is put and
announced (`router.endpoint.added`), unless that generation left service since (an ended incident replaced it or
found it gone, or its record says failed or stopped: a ready redelivered late), and a stopped engine's is deleted
and withdrawn (`router.endpoint.removed`).

An incident's own engines are routed by its steps (routes.py): a failing engine is never announced, and a
successor is announced by its incident's route-in, with its predecessor, whether its ready event comes before or
after. Event ids are derived from the engine and its generation, so a redelivered event announces nothing twice.
"""

from __future__ import annotations

import logging

from libs.common.bus import Bus
from libs.common.etcd_batch import BatchWriter
from libs.common.events import EndpointAdded, EndpointRemoved, EngineReady, EngineRole
from services.controller.open_incidents import OpenIncidents
from services.controller.routes import IncidentEvents, endpoint_key
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.routes")


class EngineRoutes:
    def __init__(self, bus: Bus, view: ClusterView, writer: BatchWriter, events: IncidentEvents,
                 open_: OpenIncidents) -> None:
        self.bus = bus
        self.view = view
        self.writer = writer
        self.events = events
        self.open = open_

    async def ready(self, e: EngineReady) -> None:
        info = e.engine
        if info.role is not EngineRole.ACTIVE or not info.endpoint:
            return
        if self.view.open_incident_for(info.engine_id) is not None:
            return  # it is failing: do not announce it
        if self.open.is_successor(info.engine_id) or e.takeover_of is not None:
            return  # a successor: route-in announces it with its predecessor (before or after this event)
        if self.view.out_of_service(info.engine_id, info.generation):
            # a late delivery (redelivered after a failed handling: an etcd stall) of an engine that died and was
            # replaced since: its route would stay, pointing at nothing (a chaos run, 2026-12-06)
            log.info("engine %s generation %d is out of service: its late ready routes nothing", info.engine_id,
                     info.generation)
            return
        self.writer.put_nowait(endpoint_key(info.model, info.engine_id), info.endpoint)
        await self.bus.publish(self.events.envelope(
            EndpointAdded(model=info.model, engine_id=info.engine_id, url=info.endpoint),
            f"ready-{info.engine_id}-g{info.generation}", None))

    async def stopped(self, engine_id: str) -> None:
        hit = self.view.endpoint_of(engine_id)
        if hit is None or self.view.open_incident_for(engine_id) is not None:
            return
        model, url = hit
        self.writer.delete_nowait(endpoint_key(model, engine_id))
        await self.bus.publish(self.events.envelope(
            EndpointRemoved(model=model, engine_id=engine_id, url=url, reason="stopped"), f"stopped-{engine_id}", None))
