"""A router whose own loop is late blames no engine: a connect to an engine that times out on the router's clock
while the engine accepts connections (asked again off the loop: reach.py) is the router's lateness, not the engine's
failure. A burst of a thousand requests held the router's loop for seconds; its connects timed out although the
kernel had finished them in milliseconds, the one healthy engine was marked suspect and most of the burst answered
503 `no_endpoint` (probe of 2026-12-07). Here the connect timeout is cut to a millisecond so that a burst makes the
loop late past it every time: each request is served, or refused as the router's own overload, never blamed on the
engine, which serves the next request at once."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from libs.common.bus import Bus
from libs.common.store import Store
from tests.router.test_router import MODEL, announce

BURST = 120


async def test_a_burst_that_makes_the_routers_loop_late_never_makes_its_healthy_engine_suspect(
        engines, start_router, bus: Bus, store: Store) -> None:  # noqa: ANN001
    a = engines("late-a")
    await asyncio.to_thread(a.wait_ready)
    await announce(bus, store, "late-a", a.url)
    router = await asyncio.to_thread(start_router, connect_timeout_s=0.001, hold_timeout_s=3, suspect_s=60,
                                     engine_spare_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=BURST + 10)) as c:
        async def one(i: int) -> tuple[int, str]:
            r = await c.post(router.url + "/v1/generate", json={"model": MODEL, "prompt": f"burst {i}", "max_tokens": 2})
            return r.status_code, "" if r.status_code == 200 else r.json()["error"]["code"]

        answers = Counter(await asyncio.gather(*(one(i) for i in range(BURST))))
        stats = router.stats()
        assert stats["reach_checks"] > 0, stats  # connects timed out: the case was met
        assert set(answers) <= {(200, ""), (503, "router_overloaded")}, answers  # was: 503 no_endpoint, all of them
        assert [ep["suspect"] for ep in stats["endpoints"][MODEL]] == [False], stats["endpoints"]
        served = 0
        for i in range(10):  # the next requests go to the engine (a millisecond's connect may still be late)
            status, _ = await one(BURST + i)
            served += status == 200
        assert served > 0
    print(f"\nburst of {BURST} with a 1 ms connect timeout: {dict(answers)}; then {served} of 10 served alone")
