"""A request that ends every engine it runs on (a "query of death") costs two engines, not the model: the router
replays a stream whose engine failed in-band once, and fails it (502 `engine_error_repeated`) when a second engine
fails while running it (relay.py invariant 6). Real router, NATS, etcd and pattern engine processes; the pattern
engine's `--fatal-prompt` plays the batched engine's failed step loop (in-band `engine_error`, then exit 70)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from libs.common.bus import Bus
from libs.common.store import Store
from tests.engine.support import EngineProc, generate, pattern_engine
from tests.router.test_router import MODEL, announce, wait_for_table


async def test_a_request_that_ends_its_engines_is_not_replayed_past_the_second(tmp_path: Path, start_router: Any,
                                                                             bus: Bus, store: Store) -> None:
    engines: list[EngineProc] = [
        pattern_engine(tmp_path, f"qod-{i}", args=("--slots", "4", "--token-interval-s", "0.005",
                                                   "--fatal-prompt", "poison")).start() for i in range(3)]
    try:
        await asyncio.gather(*(asyncio.to_thread(e.wait_ready) for e in engines))
        router = start_router(max_replays=3)
        for e in engines:
            await announce(bus, store, e.engine_id, e.url)
        await asyncio.to_thread(wait_for_table, router, {e.engine_id for e in engines})

        lines: list[dict[str, Any]] = []
        async with httpx.AsyncClient(timeout=60) as c, c.stream(
                "POST", router.url + "/v1/generate",
                json={"model": MODEL, "prompt": "a poison pill", "max_tokens": 50, "stream": True}) as r:
            assert r.status_code == 200
            lines = [json.loads(line) async for line in r.aiter_lines() if line.strip()]
        final = lines[-1]
        assert final["done"] and final["error"]["code"] == "engine_error_repeated", final
        assert [x["index"] for x in lines[:-1]] == [0, 1]  # each engine's one token, none repeated by the replay

        deadline = time.monotonic() + 10
        while sum(e.child.alive() for e in engines) > 1:  # the two that ran it end (exit 70)
            assert time.monotonic() < deadline, [e.child.alive() for e in engines]
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # had the router replayed it a third time, the last engine would end too
        survivors = [e for e in engines if e.child.alive()]
        assert len(survivors) == 1
        stats = router.stats()
        assert (stats["replayed"], stats["failed"]) == (1, 1), stats
        expected = generate(survivors[0].url, prompt="an ordinary request", max_tokens=8)["tokens"]
        async with httpx.AsyncClient(timeout=60) as c:
            ok = await c.post(router.url + "/v1/generate", json={"model": MODEL, "prompt": "an ordinary request",
                                                                 "max_tokens": 8})
        assert ok.status_code == 200 and ok.json()["tokens"] == expected
    finally:
        for e in engines:
            e.stop()
