"""Controller wiring: the view (every instance), the API (every instance), the pipeline (leader only)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets

from libs.common.errors import InvariantBroken
from libs.common.gc_tuning import count_pauses, paused_ms, service_gc
from libs.common.retention import Retention, prune_forever
from libs.common.service import Runtime
from libs.common.store import LeaderElection
from services.controller.api.app import bind, create_app, serve
from services.controller.api.context import ApiContext
from services.controller.incident_log import incident_key
from services.controller.metrics import ControllerMetrics
from services.controller.pipeline import IncidentDriver
from services.controller.rollout_driver import RolloutDriver
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller")


def admin_token(settings: ControllerSettings) -> str:
    """The configured token, or one generated once into the state dir (readable by this user only)."""
    if settings.admin_token:
        return settings.admin_token
    path = settings.ensure_state_dir() / "controller-admin-token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24))
        log.info("generated the admin API token into %s", path)
    return path.read_text().strip()


async def setup(rt: Runtime, settings: ControllerSettings) -> None:
    view = ClusterView()
    election = LeaderElection(rt.store, "controller", settings.instance, ttl=settings.leader_ttl_s)
    state = {"leader": False, "api": ""}
    metrics = ControllerMetrics(view, lambda: bool(state["leader"]))
    driver = IncidentDriver(rt.bus, rt.store, view, settings, metrics)

    rt.spawn("view", view.follow(rt.store))
    await asyncio.wait_for(view.synced.wait(), 30)
    service_gc()
    count_pauses()
    if settings.api_enabled:
        ctx = ApiContext(settings=settings, view=view, store=rt.store, bus=rt.bus, metrics=metrics,
                         is_leader=lambda: bool(state["leader"]), admin_token=admin_token(settings),
                         read_token=settings.read_token)
        sock = bind(settings.api_host, settings.api_port)
        host, port = sock.getsockname()[:2]
        state["api"] = f"http://{host}:{port}"
        rt.spawn("api", serve(create_app(ctx), sock))
        log.info("admin API on %s", state["api"])

    async def lead() -> None:
        await election.campaign()
        state["leader"] = True
        log.info("%s leads", settings.instance)
        await driver.start()
        rt.spawn("deadlines", driver.run_deadlines())
        rt.spawn("rollouts", RolloutDriver(rt.store, view, settings.tick_s).run())
        policy = Retention(settings.incident_retention_s, settings.incident_retention_max,
                           settings.incident_retention_min_s)
        rt.spawn("retention", prune_forever(view.ended, lambda inc_id: driver.writer.delete_nowait(incident_key(inc_id)),
                                            policy, settings.incident_retention_check_s, "ended incident records"))
        # Leadership ends when the election lease expires or a fenced write finds another leader's key.
        lost = [asyncio.create_task(election.lost.wait()), asyncio.create_task(driver.writer.lost.wait())]
        await asyncio.wait(lost, return_when=asyncio.FIRST_COMPLETED)
        # Another controller may already act: stop at once; the supervisor restarts us as a candidate.
        raise InvariantBroken("controller leadership lost")

    rt.health_detail = lambda: {"leader": state["leader"], "api": state["api"], "open_incidents": len(driver.open),
                                "view_revision": view.revision, "etcd_transactions": driver.writer.transactions,
                                "records_not_written": driver.writer.deferred_dropped, "ended_incidents": len(view.ended),
                                "gc_paused_ms": round(paused_ms(), 1)}
    rt.on_close(driver.writer.flush)  # a clean stop writes what is queued (fenced: only while leading)
    rt.on_close(election.resign)
    rt.spawn("leadership", lead())
