"""Replays of a dead engine's streams sent to the successor as one `POST /generate_many` (resume_batch.py): real
NATS, etcd, batched engine processes (tiny model, deterministic mode) and a router process. Every stream ends
complete and equal to the uninterrupted output, the router sent its replays in one request, and a client that
goes away after the resume has its sequence aborted at the engine while the others finish."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from libs.common.bus import Bus
from libs.common.store import Store
from tests.engine_batched.test_server import Engine
from tests.router.test_router import MODEL, announce, assert_one_complete_stream, retire, stream_lines

ARGS = ("--deterministic", "--prefill-chunk", "32")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Engine, Engine]]:
    """A serving engine and its successor-to-be (batched, tiny, deterministic), started side by side."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with ThreadPoolExecutor(2) as ex:
        starts = [ex.submit(Engine, tmp_path / name, *ARGS) for name in ("a", "b")]
    try:
        a, b = (s.result() for s in starts)
        yield a, b
    finally:
        for s in starts:
            if s.exception() is None:
                s.result().child.stop()


async def leave_after(client: httpx.AsyncClient, url: str, body: dict[str, Any], seen: asyncio.Event,
                      resumed: asyncio.Event, after: int, leave: int) -> int:
    """A client that reads token lines (`seen` set after `after`), and goes away `leave` lines after `resumed`
    is set; returns how many it read after that."""
    since: int | None = None
    async with client.stream("POST", url + "/v1/generate", json={"model": MODEL, "stream": True, **body}) as r:
        async for n in count_tokens(r.aiter_lines()):
            if n >= after:
                seen.set()
            if resumed.is_set():
                since = 0 if since is None else since + 1
                if since >= leave:
                    break
    return since or 0


async def count_tokens(lines: Any) -> Any:
    n = 0
    async for line in lines:
        if line.strip() and "token" in json.loads(line):
            n += 1
            yield n


async def test_streams_cut_by_a_sigkill_resume_on_the_successor_in_one_batched_request(
        pair: tuple[Engine, Engine], start_router, bus: Bus, store: Store) -> None:
    a, b = pair
    router = start_router()
    await announce(bus, store, "batch-a", a.url)
    bodies = [{"prompt": f"stream {i} outlives its engine", "max_tokens": 300, "ignore_eos": True}
              for i in range(8)]
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
    assert stats["completed"] == len(bodies) and stats["failed"] == 0
    assert stats["resume_batches"] == {"batches": 1, "batched_requests": len(bodies)}


async def test_a_client_that_leaves_after_a_batched_resume_is_aborted_at_the_engine_and_the_others_finish(
        pair: tuple[Engine, Engine], start_router, bus: Bus, store: Store) -> None:
    a, b = pair
    router = start_router()
    await announce(bus, store, "leave-a", a.url)
    # 600 tokens: the leaver's 20 after the resume and its abort take a few dozen steps, the others run ~550 more
    stay = [{"prompt": f"stays {i}", "max_tokens": 600, "ignore_eos": True} for i in range(3)]
    goes = {"prompt": "goes away", "max_tokens": 600, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as c:
        expected = [r.json()["tokens"] for r in await asyncio.gather(
            *(c.post(b.url + "/generate", json=body) for body in stay))]
        seen = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.create_task(stream_lines(c, router.url, body, ev, after=5))
                 for body, ev in zip(stay, seen[:3], strict=True)]
        killed = asyncio.Event()
        leaver = asyncio.create_task(leave_after(c, router.url, goes, seen[3], killed, after=5, leave=20))
        await asyncio.gather(*(ev.wait() for ev in seen))
        a.child.kill(signal.SIGKILL)
        killed.set()  # the leaver goes away 20 tokens later: on the successor, in the batch
        await retire(bus, store, "leave-a", "killed")
        await announce(bus, store, "leave-b", b.url, predecessor_id="leave-a")
        assert await leaver == 20
        deadline = time.monotonic() + 10
        while not (eng := b.health()["engine"])["aborted"]:
            assert time.monotonic() < deadline, eng
            await asyncio.sleep(0.01)
        # ended by /abort while the others run on the shared connection (not by that connection's end)
        assert eng["live"] == 3, eng
        results = await asyncio.gather(*tasks)
    for lines, want in zip(results, expected, strict=True):
        assert_one_complete_stream(lines, want)
    assert router.stats()["resume_batches"] == {"batches": 1, "batched_requests": 4}
    assert b.health()["engine"]["aborted"] == 1
