"""A node command sent while its service restarts (nobody subscribed: `Unavailable` at once) is asked again for the
sender's window, not three times in 0.3 s: a gpu_manager restarted by its supervisor right after an incident opened
missed every try of the freeze, and the incident failed (probe of 2026-12-07). Real NATS; the node's service comes
up 1.2 s after the first try."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from libs.common.bus import Bus
from libs.common.bus.commands import retried_unanswered
from libs.common.config import CommonSettings
from libs.common.errors import Unavailable
from libs.common.events import Thaw, ThawReply
from tests.support import OwnNats


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


async def thaw_pair(url: str, settings: CommonSettings) -> tuple[Bus, Bus]:
    """A caller and node-1's gpu_manager answering Thaw, both connected to `url`."""
    own = settings.model_copy(update={"nats_url": url})
    caller = await Bus.connect(own, "test", stream=False)
    service = await Bus.connect(own.model_copy(update={"node": "node-1"}), "gpu_manager:node-1", stream=False)

    async def thaw(cmd: Thaw) -> ThawReply:
        return ThawReply(lease_ids=[cmd.incident_id])

    await service.serve("node-1", Thaw, thaw)
    return caller, service


async def test_tries_made_while_the_callers_own_bus_was_down_are_not_counted(
        settings: CommonSettings, nats_conf, tmp_path) -> None:  # noqa: ANN001
    """A 7 s NATS restart failed the dc_manager's freeze (three unanswered tries, the node blamed) and its incident
    went to a cold start beside a warm standby (probe of 2026-12-07). A nats-server of the test's own is stopped as
    the command is sent and started again 3 s later: the command is answered once the caller's connection is back."""
    server = OwnNats(tmp_path, nats_conf)
    caller, service = await thaw_pair(server.url, settings)
    try:
        server.stop()

        async def back_later() -> None:
            await asyncio.sleep(3.0)
            await asyncio.to_thread(server.start)

        later = asyncio.create_task(back_later())
        reply = await retried_unanswered(lambda: caller.request("node-1", Thaw(incident_id="inc-2"), ThawReply,
                                                                timeout=0.5), 3, 0.1, window_s=1.0, link=caller.nc)
        assert reply.lease_ids == ["inc-2"]
        await later
    finally:
        await caller.close()
        await service.close()
        server.stop()


async def test_tries_made_while_the_callers_server_was_stalled_are_not_counted(
        settings: CommonSettings, nats_conf, tmp_path) -> None:  # noqa: ANN001
    """A stalled server (SIGSTOP, a frozen host) keeps the connection open and nats-py "connected": the dc_manager's
    freeze went unanswered three times, its incident went to a fallback and failed while the standby served (probe
    of 2026-12-07). The caller's own server is stopped as the command is sent and resumed 3 s later."""
    server = OwnNats(tmp_path, nats_conf)
    caller, service = await thaw_pair(server.url, settings)
    pid = server.child.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        resumed = asyncio.get_running_loop().call_later(3.0, os.kill, pid, signal.SIGCONT)
        try:
            reply = await retried_unanswered(
                lambda: caller.request("node-1", Thaw(incident_id="inc-3"), ThawReply, timeout=0.5), 3, 0.1,
                window_s=1.0, link=caller.nc)
        finally:
            resumed.cancel()
            os.kill(pid, signal.SIGCONT)
        assert reply.lease_ids == ["inc-3"]
    finally:
        await caller.close()
        await service.close()
        server.stop()
