"""`Bus.publish_all` (what the controller publishes a step's events with) against a real nats-server."""

from __future__ import annotations

import pytest
from nats.js.errors import NoStreamResponseError

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import EndpointAdded, IncidentResolved


async def test_events_published_together_are_all_stored_once_in_order(bus: Bus) -> None:
    envs = [bus.envelope(EndpointAdded(model="m", engine_id="e1-s1", url="http://127.0.0.1:9/e1", incident_id="i1",
                                       predecessor_id="e1"), id="i1-added"),
            bus.envelope(IncidentResolved(incident_id="i1", engine_id="e1", successor_id="e1-s1"), id="i1-resolved")]
    await bus.publish_all(envs)
    await bus.publish_all(envs)  # a retry after a crash: the stream's duplicate window drops it
    stored = [e for subject in ("router.endpoint.added", "incident.resolved") for e in await bus.replay(subject)]
    assert [e.id for e in stored] == ["i1-added", "i1-resolved"]


async def test_an_event_no_stream_takes_is_an_error_not_a_silent_loss(settings: CommonSettings) -> None:
    lost = await Bus.connect(settings.model_copy(update={"subject_prefix": settings.subject_prefix + "x"}), "test",
                             stream=False)
    try:
        env = lost.envelope(IncidentResolved(incident_id="i2", engine_id="e2"), id="i2-resolved")
        with pytest.raises(NoStreamResponseError):
            await lost.publish_all([env])
        assert not lost._acks  # nothing left waiting
    finally:
        await lost.close()
