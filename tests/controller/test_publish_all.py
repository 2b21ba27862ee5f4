"""`Bus.publish_all` (what the controller publishes a step's events with) against a real nats-server."""

from __future__ import annotations

import contextlib

import pytest
from nats.js.api import StreamConfig
from nats.js.errors import APIError, NoStreamResponseError

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
        assert not lost.link.inbox.waiting  # nothing left waiting
    finally:
        await lost.close()


async def test_a_stream_that_refuses_an_event_fails_the_wait_with_its_error(settings: CommonSettings) -> None:
    # Stream acks are read without a JSON parse when they are plain PubAcks; an error ack still fails the wait.
    small = settings.model_copy(update={"subject_prefix": settings.subject_prefix + "s",
                                        "stream_name": settings.stream_name + "S"})
    bus = await Bus.connect(small, "test", stream=False)
    try:
        await bus.js.add_stream(StreamConfig(name=small.stream_name, subjects=[f"{small.subject_prefix}.incident.>"],
                                             max_msg_size=64))
        env = bus.envelope(IncidentResolved(incident_id="i3", engine_id="e3"), id="i3-resolved")
        with pytest.raises(APIError):
            await bus.publish_all([env])
        assert not bus.link.inbox.waiting
        # What the fast path expects of an accepted event's ack (nats-server's PubAck), and a duplicate's:
        await bus.js.update_stream(StreamConfig(name=small.stream_name, subjects=[f"{small.subject_prefix}.incident.>"],
                                                max_msg_size=-1))
        subject = f"{small.subject_prefix}.incident.x"
        first = await bus.nc.request(subject, b"{}", headers={"Nats-Msg-Id": "d1"}, timeout=2)
        again = await bus.nc.request(subject, b"{}", headers={"Nats-Msg-Id": "d1"}, timeout=2)
        assert first.data.startswith(b'{"stream":') and b'"error"' not in first.data
        assert again.data.startswith(b'{"stream":') and b'"duplicate"' in again.data
        await bus.publish_all([env])
        assert [e.id for e in await bus.replay("incident.resolved")] == ["i3-resolved"]
    finally:
        with contextlib.suppress(Exception):
            await bus.js.delete_stream(small.stream_name)
        await bus.close()
