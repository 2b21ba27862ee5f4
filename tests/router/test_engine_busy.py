"""An engine at its queue's bound (`queue_full`) is sound: the router answers a new request 503 `queue_full` at once
and keeps routing to that engine, instead of taking the refusal for a failure, avoiding the idle engine for
`suspect_s` and answering `no_endpoint` (probe of 2026-12-06: 984 of 3000 requests of a burst). A real batched engine
(tiny model, CPU) and a real router."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from libs.common.store import Store
from tests.engine_batched.test_server import Engine
from tests.router.conftest import RouterProc

READ_S = 60


def _hold(url: str, stop: threading.Event, started: list[int]) -> None:
    """Long streams on the engine, one after another until `stop` (its client then goes: the engine frees its slot).
    One stream reaches the tiny model's context end in a second or two on the CPU; the next one keeps the slot."""
    body = {"prompt": "filler", "max_tokens": 100_000, "ignore_eos": True, "stream": True}  # to the context's end
    while not stop.is_set():
        try:
            with httpx.stream("POST", url + "/generate", json=body, timeout=READ_S) as r:
                started.append(r.status_code)
                for _ in r.iter_lines():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            pass


async def test_a_full_engine_is_not_taken_for_a_failed_one(tmp_path: Path, store: Store,
                                                           start_router: Callable[..., RouterProc]) -> None:
    engine = await asyncio.to_thread(Engine, tmp_path, "--max-waiting", "2", "--max-num-seqs", "2")
    stop = threading.Event()
    fillers: list[threading.Thread] = []
    try:
        model = (await asyncio.to_thread(engine.health))["model"]
        await store.put(f"endpoints/{model}/busy-a", engine.url)
        router = await asyncio.to_thread(start_router, hold_timeout_s=2, suspect_s=30)
        started: list[int] = []
        for _ in range(4):  # 2 running + 2 waiting: the engine's bound
            t = threading.Thread(target=_hold, args=(engine.url, stop, started), daemon=True)
            t.start()
            fillers.append(t)
        deadline = time.monotonic() + READ_S
        while (await asyncio.to_thread(engine.health))["in_flight"] < 4:
            assert time.monotonic() < deadline, "the fillers never filled the engine"
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=router.url, timeout=READ_S) as c:
            body = {"model": model, "prompt": "one", "max_tokens": 4}
            for _ in range(50):  # a filler between two of its streams leaves a slot for a moment: that one is served
                r = await c.post("/v1/completions", json=body)
                if r.status_code != 200:
                    break
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
            stop.set()  # the fillers go: the engine is idle again
            for t in fillers:
                await asyncio.to_thread(t.join, READ_S)
            while (await asyncio.to_thread(engine.health))["in_flight"] > 0:
                assert time.monotonic() < deadline, "the engine never emptied"
                await asyncio.sleep(0.05)
            r = await c.post("/v1/completions", json=body)  # at once: it was never suspect (30 s here)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
            stats = (await c.get("/stats")).json()
        assert stats["replayed"] == 0, stats
    finally:
        stop.set()
        engine.child.stop()
