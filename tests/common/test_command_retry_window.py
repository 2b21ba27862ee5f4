"""A node command sent while its service restarts (nobody subscribed: `Unavailable` at once) is asked again for the
sender's window, not three times in 0.3 s: a gpu_manager restarted by its supervisor right after an incident opened
missed every try of the freeze, and the incident failed (probe of 2026-12-07). Real NATS; the node's service comes
up 1.2 s after the first try."""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.common.bus import Bus
from libs.common.bus.commands import retried_unanswered
from libs.common.config import CommonSettings
from libs.common.errors import Unavailable
from libs.common.events import Thaw, ThawReply


async def test_a_service_that_comes_back_within_the_window_is_answered(bus: Bus, settings: CommonSettings) -> None:
    node = "node-1"
    asked = Thaw(incident_id="inc-1")
    with pytest.raises(Unavailable):  # no window: three tries, 0.3 s, all missed
        await retried_unanswered(lambda: bus.request(node, asked, ThawReply, timeout=1), 3, 0.1)

    async def come_up_later() -> Bus:
        await asyncio.sleep(1.2)
        service = await Bus.connect(settings.model_copy(update={"node": node}), f"gpu_manager:{node}", stream=False)

        async def thaw(cmd: Thaw) -> ThawReply:
            return ThawReply(lease_ids=[cmd.incident_id])

        await service.serve(node, Thaw, thaw)
        return service

    t0 = time.monotonic()
    later = asyncio.create_task(come_up_later())
    try:
        reply = await retried_unanswered(lambda: bus.request(node, asked, ThawReply, timeout=1), 3, 0.1,
                                         window_s=3.0)
        assert reply.lease_ids == ["inc-1"] and 1.2 <= time.monotonic() - t0 < 3.5
    finally:
        await (await later).close()
