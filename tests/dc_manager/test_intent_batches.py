"""Intents delivered together are handled together, each with its own outcome: the prompt ones reattach with one
result each, a node's typed error fails only its intent (a failed result, acked), an intent that makes the handler
raise is redelivered, a malformed one is terminated."""

from __future__ import annotations

import asyncio

from devstack.simcluster import SimulatedCluster
from libs.common.bus import MAX_DELIVER, Bus, delivery_attempts
from libs.common.cluster_view import ClusterView
from libs.common.config import CommonSettings
from libs.common.events import Envelope, FaultDetected, FaultKind, IntentResult, RecoverIntent, event_subject
from libs.common.store import Store
from services.dc_manager.executor import IntentExecutor
from services.dc_manager.settings import DcManagerSettings
from tests.controller.helpers import wait_for


async def test_intents_delivered_together_each_get_their_own_outcome(bus: Bus, store: Store,
                                                                     settings: CommonSettings) -> None:
    sim = SimulatedCluster(bus, store, nodes=2, gpus_per_node=5, emit_events=False)
    await sim.populate()
    await sim.serve()
    engines = list(sim.engines)
    gone = engines[-1]
    sim.owned[gone] = set()  # its node holds no leases of it: the freeze answers not_found
    view = ClusterView()
    follow = asyncio.create_task(view.follow(store))
    await asyncio.wait_for(view.synced.wait(), 10)
    executor = IntentExecutor(bus, store, view, DcManagerSettings(**settings.model_dump(), freeze_result_after_s=30))
    executor.export_spans = False  # as in a service without an exporter (with one, each intent goes alone)

    intents = [RecoverIntent(incident_id=f"inc-{i}", engine_id=e, model="m", node=sim.engines[e].node,
                             gpu=sim.engines[e].gpu) for i, e in enumerate(engines)]
    await bus.publish_all([bus.wired(intent, id=f"intent-{intent.incident_id}") for intent in intents])
    subject = event_subject(bus.prefix, RecoverIntent)
    await bus.js.publish(subject, b"not an envelope")  # stored, then terminated
    stray = bus.wired(FaultDetected(engine_id="x", kind=FaultKind.KILLED), id="stray")  # not an intent: its handler raises
    await bus.js.publish(subject, stray.body, headers=stray.headers)

    batches: list[list[str]] = []
    stray_deliveries: list[int] = []

    async def counted(envs: list[Envelope]) -> list[BaseException | None]:
        batches.append([env.id for env in envs])
        stray_deliveries.extend(n for env, n in zip(envs, delivery_attempts.get(), strict=True) if env.id == "stray")
        return await executor.on_intents(envs)

    await bus.durable_batches("intent.recover", "dcm-batches", counted, concurrency=64, ack_wait=2.0, shared=True)
    try:
        async def all_results() -> list[IntentResult] | None:
            got = [e.data for e in await bus.replay("intent.result") if isinstance(e.data, IntentResult)]
            return got if len(got) >= len(intents) else None

        await wait_for(all_results, what="a result for every intent")
        await wait_for(lambda: _at_least(stray_deliveries, MAX_DELIVER), what="the stray event's redeliveries")
        await asyncio.sleep(2.5)  # past ack_wait: an intent handled but not acked would come again by now
        results = await all_results() or []
        by_incident = {r.incident_id: r for r in results}
        assert len(results) == len(intents) == len(by_incident)  # one result each, no duplicates
        for intent in intents[:-1]:
            r = by_incident[intent.incident_id]
            assert (r.step, r.ok, r.successor_id) == ("reattach", True, f"{intent.engine_id}-s1")
            assert r.frozen_at is not None and r.timings_ms.keys() >= {"freeze", "reattach"}
            assert (await store.get(f"dcm/intents/{intent.incident_id}-recover")) is not None  # the freeze recorded
        failed = by_incident[intents[-1].incident_id]
        assert (failed.step, failed.ok) == ("freeze", False) and "not_found" in failed.detail
        assert sim.takeover_calls == len(intents) - 1
        assert sim.freeze_calls == len(intents) + 1  # the failed one's freeze asked again on its own path
        intent_ids = {f"intent-{i.incident_id}" for i in intents}
        assert sorted(e for b in batches for e in b if e in intent_ids) == sorted(intent_ids)  # each intent once
        assert max(len(b) for b in batches) > 1  # stored intents delivered at once are handled together
        assert stray_deliveries == list(range(1, MAX_DELIVER + 1))  # nak'd each time, never acked
        assert bus.rejected == 1  # the malformed one, terminated
        assert executor.handled == len(intents) and not executor._locks
    finally:
        follow.cancel()


async def _at_least(items: list[int], n: int) -> bool:
    return len(items) >= n
