"""Intent results get more slots than faults: ending incidents keeps pace with opening them.

A result holds its consumer slot through route-in, its end's record write and the end's announcement (three round
trips; a fault's opening, two). With as many slots as the faults, a burst's results queued behind new incidents for
seconds (2026-12-02: 1.3 s median from a result's publication to its handling, against 0.04 s before the end was
recorded first), so most incidents outlived `waiting_record_delay_s` and had their waiting record written, and the
open incidents the deadline pass scans each tick piled up (docs/controlplane.md). Real NATS and etcd.
"""

from __future__ import annotations

from nats.js.api import AckPolicy, ConsumerConfig

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import subscription_subject
from libs.common.store import Store
from services.controller.metrics import ControllerMetrics
from services.controller.pipeline import IncidentDriver
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView

FENCE = "test/fence"


async def test_the_results_consumer_takes_more_events_at_once_than_the_faults_consumer(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    await _slots_after_start(bus, store, settings)


async def test_a_results_consumer_made_by_an_earlier_version_gets_the_new_slots(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    """The durable outlives the controller: one made with the faults' 256 slots is updated in place at start."""
    await bus.js.add_consumer(settings.stream_name, config=ConsumerConfig(
        durable_name="controller-intents", name="controller-intents", ack_policy=AckPolicy.EXPLICIT,
        max_ack_pending=256, ack_wait=3.0, max_deliver=5,
        filter_subject=subscription_subject(bus.prefix, "intent.result")))
    await _slots_after_start(bus, store, settings)


async def _slots_after_start(bus: Bus, store: Store, settings: CommonSettings) -> None:
    await store.put(FENCE, "held")
    view = ClusterView()
    conf = ControllerSettings(**settings.model_dump(), instance="c-test", api_enabled=False)
    driver = IncidentDriver(bus, store, view, conf, ControllerMetrics(view, lambda: True),
                            fence=lambda t: [t.value(store.full(FENCE)) == b"held"])
    await driver.start()
    try:
        stream = settings.stream_name
        faults = await bus.js.consumer_info(stream, "controller-faults")
        results = await bus.js.consumer_info(stream, "controller-intents")
        assert faults.config.max_ack_pending == conf.concurrency
        assert results.config.max_ack_pending == conf.result_concurrency > conf.concurrency
    finally:
        await driver.stop()
