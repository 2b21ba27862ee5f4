"""Replays of a dead engine's streams sent to the successor as one `POST /generate_many` (resume_batch.py): real
NATS, etcd, batched engine processes (tiny model, deterministic mode) and a router process. Every stream ends
complete and equal to the uninterrupted output, and the router sent its replays in one request."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx

from libs.common.bus import Bus
from libs.common.store import Store
from tests.engine_batched.test_server import Engine
from tests.router.test_router import announce, assert_one_complete_stream, retire, stream_lines

STREAMS = 8
ARGS = ("--deterministic", "--prefill-chunk", "32")


async def test_streams_cut_by_a_sigkill_resume_on_the_successor_in_one_batched_request(
        tmp_path: Path, start_router, bus: Bus, store: Store) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = await asyncio.gather(asyncio.to_thread(Engine, tmp_path / "a", *ARGS),
                                asyncio.to_thread(Engine, tmp_path / "b", *ARGS))
    try:
        router = start_router()
        await announce(bus, store, "batch-a", a.url)
        bodies = [{"prompt": f"stream {i} outlives its engine", "max_tokens": 300, "ignore_eos": True}
                  for i in range(STREAMS)]
        async with httpx.AsyncClient(timeout=60) as c:
            expected = [r.json()["tokens"] for r in await asyncio.gather(
                *(c.post(b.url + "/generate", json=body) for body in bodies))]
            seen = [asyncio.Event() for _ in bodies]
            tasks = [asyncio.create_task(stream_lines(c, router.url, body, ev, after=10))
                     for body, ev in zip(bodies, seen, strict=True)]
            await asyncio.gather(*(ev.wait() for ev in seen))
            a.child.kill(signal.SIGKILL)  # every stream has 10 of its 300 tokens
            await retire(bus, store, "batch-a", "killed")
            await announce(bus, store, "batch-b", b.url, predecessor_id="batch-a")
            results = await asyncio.gather(*tasks)
        for lines, want in zip(results, expected, strict=True):
            assert_one_complete_stream(lines, want)
            assert lines[-1]["engines"][-1] == "batch-b"
        stats = router.stats()
        assert stats["completed"] == STREAMS and stats["failed"] == 0
        assert stats["resume_batches"] == {"batches": 1, "batched_requests": STREAMS}
    finally:
        a.child.stop()
        b.child.stop()
