"""A router told of a routed engine's standby (`router.endpoint.standby`, the controller's standbys.py) keeps spare
connections open to it before any failure, and forgets it when its engine is removed (real NATS and a router
process; the standby a loopback server that counts the connections it accepts)."""

from __future__ import annotations

import asyncio
import time

from libs.common.bus import Bus
from libs.common.events import EndpointRemoved, EndpointStandby
from tests.router.test_spare import Server

MODEL = "tiny-ref"


async def _until(cond, what: str, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout  # a guard against hanging, not a performance figure
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_standby_announced_gets_spare_connections_before_any_failure_and_is_forgotten_with_its_engine(
        start_router, bus: Bus) -> None:  # noqa: ANN001
    standby = Server()
    standby.url = await standby.start()
    try:
        router = start_router(engine_spare_connections=3)
        await bus.emit(EndpointStandby(model=MODEL, engine_id="e-active", standby_id="e-standby",
                                       standby_url=standby.url))
        # opened at once, not after the keeper's settling: the standby serves nothing meanwhile
        await _until(lambda: standby.accepted >= 3, f"no spares to the standby: {router.stats()}")
        assert router.stats()["spare_connections"]["open"] >= 3
        # the engine it stood by for is removed (killed): the router keeps no spares to that standby for it any more
        # (it is promised as an endpoint of its own only when the removal names it as the successor)
        await bus.emit(EndpointRemoved(model=MODEL, engine_id="e-active", reason="killed"))
        await _until(lambda: router.stats()["spare_connections"]["open"] == 0,
                     f"spares to a forgotten standby kept: {router.stats()}")
    finally:
        await standby.stop()
