"""Controller wiring: the view (every instance), the API (every instance, on a thread of its own: `api/server.py`),
the pipeline (leader only, one term at a time: `leadership.py` steps down on a lost lease and campaigns again)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from libs.common.gc_tuning import count_pauses, paused_ms, service_gc
from libs.common.retention import Retention, prune_forever
from libs.common.service import Runtime
from libs.common.store import LeaderElection
from libs.common.web.keyfile import token_file
from services.controller.api.server import ApiThread, bind
from services.controller.incident_log import incident_key, ledger_key
from services.controller.leadership import lead_forever
from services.controller.metrics import ControllerMetrics
from services.controller.pipeline import IncidentDriver
from services.controller.regroup_driver import RegroupDriver
from services.controller.rollout_driver import RolloutDriver
from services.controller.settings import ControllerSettings
from services.controller.standbys import StandbyAnnouncer
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller")


def admin_token(settings: ControllerSettings) -> str:
    """The configured token, or one generated once into the state dir (readable by this user only)."""
    if settings.admin_token:
        return settings.admin_token
    if settings.api_tokens:
        return ""  # hashed tokens configured: no plain token is made (api/tokens.py)
    return token_file(settings.ensure_state_dir() / "controller-admin-token", "the admin API token")


class LeaderTerm:
    """What one term of leadership runs (`leadership.Term`): the incident pipeline, its deadline pass, the
    roll-out and regroup passes and the retention of ended records, each term with a fresh driver fenced by its key."""

    def __init__(self, rt: Runtime, view: ClusterView, settings: ControllerSettings, metrics: ControllerMetrics,
                 election: LeaderElection) -> None:
        self.settings = settings
        self.view = view
        self.driver = IncidentDriver(rt.bus, rt.store, view, settings, metrics, fence=election.fence,
                                     tenure=election)
        self.rollouts = RolloutDriver(rt.store, view, settings.tick_s)
        self.regroups = RegroupDriver(rt.store, view, settings.regroup_after_s)
        self.lost = self.driver.writer.lost

    def tasks(self) -> dict[str, Coroutine[Any, Any, Any]]:
        s = self.settings
        policy = Retention(s.incident_retention_s, s.incident_retention_max, s.incident_retention_min_s)
        delete = self.driver.writer.delete_nowait
        optional: dict[str, Coroutine[Any, Any, Any]] = {}
        if s.regroup_after_s > 0:
            optional["regroups"] = self.regroups.run()
        if s.standby_announce_s > 0:  # routers keep spare connections to each engine's likely successor
            optional["standbys"] = StandbyAnnouncer(self.driver.bus, self.view, s.standby_announce_s,
                                                    s.standby_refresh_s).run()
        return {"deadlines": self.driver.run_deadlines(), "rollouts": self.rollouts.run(), **optional,
                "retention": prune_forever(self.view.ended, lambda inc_id: delete(incident_key(inc_id)), policy,
                                           s.incident_retention_check_s, "ended incident records"),
                # A ledger of announced ends goes once retention has deleted every record it names.
                "ledgers": prune_forever(self.view.announced.spent, lambda ledger_id: delete(ledger_key(ledger_id)),
                                         Retention(0.0, 0, 0.0), s.incident_retention_check_s,
                                         "ledgers of announced ends")}

    async def stop(self) -> None:
        await self.driver.stop()


async def setup(rt: Runtime, settings: ControllerSettings) -> None:
    view = ClusterView()
    election = LeaderElection(rt.store, "controller", settings.instance, ttl=settings.leader_ttl_s)
    state: dict[str, Any] = {"leader": False, "api": "", "term": None, "terms": 0}
    metrics = ControllerMetrics(view, lambda: bool(state["leader"]))

    rt.spawn("view", view.follow(rt.store))
    await asyncio.wait_for(view.synced.wait(), 30)
    service_gc()
    count_pauses()
    if settings.api_enabled:
        # Its own thread, loop, etcd and NATS connections and view: no request is parsed on the pipeline's loop.
        sock = bind(settings.api_host, settings.api_port)
        host, port = sock.getsockname()[:2]
        api = ApiThread(settings, sock, metrics, lambda: bool(state["leader"]), admin_token(settings))
        api.start()
        rt.spawn("api", api.run())
        await api.wait_ready()
        state["api"] = f"http://{host}:{port}"
        log.info("admin API on %s", state["api"])

    async def begin() -> LeaderTerm:
        term = LeaderTerm(rt, view, settings, metrics, election)
        await term.driver.start()  # resumes open incidents, then consumes
        state["term"] = term
        state["terms"] += 1
        log.info("%s leads (term %d)", settings.instance, election.term)
        return term

    def on_change(leading: bool) -> None:
        state["leader"] = leading

    def health() -> dict[str, Any]:
        term: LeaderTerm | None = state["term"]
        writer = term.driver.writer if term else None
        return {"leader": state["leader"], "api": state["api"], "terms": state["terms"],
                "open_incidents": len(term.driver.open) if term else 0, "view_revision": view.revision,
                "etcd_transactions": writer.transactions if writer else 0,
                "records_not_written": writer.deferred_dropped if writer else 0, "ended_incidents": len(view.ended),
                "gc_paused_ms": round(paused_ms(), 1)}

    rt.health_detail = health
    rt.on_close(election.resign)  # after the leadership task's own step-down (a no-op then)
    # Losing leadership steps down and campaigns again (leadership.py); only a broken invariant ends the process.
    rt.spawn("leadership", lead_forever(election, begin, on_change))
