"""dc_manager wiring: the view (for placement) and a durable, concurrent consumer of recover intents."""

from __future__ import annotations

import asyncio

from libs.common.cluster_view import ClusterView
from libs.common.gc_tuning import service_gc
from libs.common.ids import subject_token
from libs.common.retention import Retention, prune_forever
from libs.common.service import Runtime
from services.dc_manager.executor import IntentExecutor
from services.dc_manager.settings import DcManagerSettings


async def setup(rt: Runtime, settings: DcManagerSettings) -> None:
    view = ClusterView()
    view.skip_heads = frozenset({"endpoints"})  # placement never reads routes: two changes per incident less
    rt.spawn("view", view.follow(rt.store))
    await asyncio.wait_for(view.synced.wait(), 30)
    service_gc()
    executor = IntentExecutor(rt.bus, rt.store, view, settings)
    await executor.steps.adopt_leftovers()  # before any intent: what earlier managers left is deleted in its time
    # One durable name per datacenter: a restarted manager resumes (and gets redelivered) its intents;
    # several managers of one datacenter share it (a deliver group): each intent goes to one of them.
    # What arrives in one loop pass is handled together (executor.on_intents, executor.py); each intent keeps
    # its own ack. With spans exported, each intent's trace is made current on its one-at-a-time path.
    await rt.bus.durable_batches("intent.recover", f"dc_manager-{subject_token(settings.datacenter)}",
                                 executor.on_intents, concurrency=settings.concurrency, ack_wait=settings.ack_wait_s,
                                 shared=True)
    policy = Retention(settings.progress_retention_s, settings.progress_retention_max,
                       settings.progress_retention_min_s)
    rt.spawn("retention", prune_forever(executor.steps.ended, executor.steps.forget, policy, settings.progress_retention_check_s,
                                        "intent progress records"))
    rt.health_detail = lambda: {"datacenter": settings.datacenter, "handled": executor.handled,
                                "refused_stale_term": executor.refused,
                                "progress_records": len(executor.steps.written) + len(executor.steps.ended),
                                "nodes": sorted(settings.node_set() or [])}
