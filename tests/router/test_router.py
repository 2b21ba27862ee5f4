"""The router with real NATS, etcd, engine processes and a router process: routing from events and the
etcd snapshot, replay of in-flight streams after a SIGKILL, holding, the queue bound, the timeout."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import httpx

from libs.common.bus import Bus
from libs.common.events import EndpointAdded, EndpointRemoved
from libs.common.store import Store
from tests.engine.support import generate

MODEL = "tiny-ref"


async def stream_lines(client: httpx.AsyncClient, url: str, body: dict[str, Any], seen: asyncio.Event | None = None,
                       after: int = 0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async with client.stream("POST", url + "/v1/generate", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.strip():
                out.append(json.loads(line))
                if seen is not None and len(out) >= after:
                    seen.set()
    return out


def wait_until_held(router: Any, n: int) -> None:
    while router.stats()["held"] != n:
        time.sleep(0.05)


def tokens_of(lines: list[dict[str, Any]]) -> list[int]:
    return [x["token"] for x in lines if "token" in x]


def assert_one_complete_stream(lines: list[dict[str, Any]], expected: list[int]) -> None:
    assert [x["index"] for x in lines[:-1]] == list(range(len(expected)))
    assert tokens_of(lines) == expected
    final = lines[-1]
    assert final["done"] is True and "error" not in final, final
    assert final["completion_tokens"] == len(expected)


async def test_router_serves_an_endpoint_found_in_the_etcd_snapshot_at_start(
        engines, start_router, store: Store) -> None:
    a = engines("snap-a")
    await asyncio.to_thread(a.wait_ready)
    await store.put(f"endpoints/{MODEL}/snap-a", {"url": a.url, "model": MODEL})
    router = start_router()
    expected = generate(a.url, prompt="snapshot", max_tokens=12, ignore_eos=True)["tokens"]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(router.url + "/v1/generate",
                         json={"model": MODEL, "prompt": "snapshot", "max_tokens": 12, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected
    assert router.stats()["completed"] == 1


async def test_a_stream_cut_by_a_sigkill_resumes_on_the_successor_and_equals_the_uninterrupted_output(
        engines, start_router, bus: Bus) -> None:
    a, b = engines("kill-a"), engines("kill-b")
    await asyncio.gather(asyncio.to_thread(a.wait_ready), asyncio.to_thread(b.wait_ready))
    router = start_router()
    await bus.emit(EndpointAdded(model=MODEL, engine_id="kill-a", url=a.url))
    body = {"prompt": "The memory outlives the engine.", "max_tokens": 400, "ignore_eos": True}
    expected = generate(b.url, **body)["tokens"]

    seen = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as c:
        task = asyncio.create_task(stream_lines(c, router.url, body, seen, after=20))
        await seen.wait()
        a.child.kill(signal.SIGKILL)  # mid-generation: 20 of 400 tokens are out
        await bus.emit(EndpointRemoved(model=MODEL, engine_id="kill-a", reason="killed"))
        await bus.emit(EndpointAdded(model=MODEL, engine_id="kill-b", url=b.url, predecessor_id="kill-a"))
        lines = await task
    assert_one_complete_stream(lines, expected)
    assert lines[-1]["replays"] >= 1 and lines[-1]["engines"][-1] == "kill-b"
    stats = router.stats()
    assert stats["replayed"] >= 1 and stats["failed"] == 0 and stats["completed"] == 1


async def test_held_requests_get_a_503_after_the_hold_timeout_and_past_the_queue_bound(start_router) -> None:
    router = start_router(hold_timeout_s=1.0, queue_max=2)
    async with httpx.AsyncClient(timeout=30) as c:
        replies = await asyncio.gather(*[
            c.post(router.url + "/v1/generate", json={"model": "nobody-serves-this", "prompt": "x", "max_tokens": 4})
            for _ in range(3)])
    assert [r.status_code for r in replies] == [503, 503, 503]
    codes = sorted(r.json()["error"]["code"] for r in replies)
    assert codes == ["no_endpoint", "no_endpoint", "queue_full"]
    assert all("nobody-serves-this" in r.json()["error"]["message"] for r in replies)
    stats = router.stats()
    assert stats["rejected"] == 3 and stats["failed"] == 3 and stats["held"] == 0


async def test_a_held_request_completes_once_an_endpoint_for_its_model_is_added(engines, start_router, bus: Bus) -> None:
    a = engines("late-a")
    router = start_router(hold_timeout_s=60)
    async with httpx.AsyncClient(timeout=90) as c:
        pending = asyncio.create_task(c.post(router.url + "/v1/generate",
                                             json={"model": MODEL, "prompt": "late", "max_tokens": 5}))
        await asyncio.to_thread(wait_until_held, router, 1)
        await asyncio.to_thread(a.wait_ready)
        await bus.emit(EndpointAdded(model=MODEL, engine_id="late-a", url=a.url))
        r = await pending
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == generate(a.url, prompt="late", max_tokens=5)["tokens"]


async def test_no_request_is_dropped_under_a_burst_while_the_engine_is_killed(engines, start_router, bus: Bus) -> None:
    a, b = engines("burst-a"), engines("burst-b")
    await asyncio.gather(asyncio.to_thread(a.wait_ready), asyncio.to_thread(b.wait_ready))
    router = start_router(hold_timeout_s=30)
    await bus.emit(EndpointAdded(model=MODEL, engine_id="burst-a", url=a.url))
    prompts = [f"request {i}: keep going" for i in range(6)]
    expected = {p: generate(b.url, prompt=p, max_tokens=120, ignore_eos=True)["tokens"] for p in prompts}

    seen = asyncio.Event()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
        first = [asyncio.create_task(stream_lines(c, router.url, {"prompt": p, "max_tokens": 120, "ignore_eos": True},
                                                  seen if i == 0 else None, after=5)) for i, p in enumerate(prompts * 2)]
        await seen.wait()
        a.child.kill(signal.SIGKILL)
        # More requests arrive while no engine serves the model: they are held, not refused.
        second = [asyncio.create_task(stream_lines(c, router.url, {"prompt": p, "max_tokens": 120, "ignore_eos": True}))
                  for p in prompts]
        await asyncio.sleep(0.2)
        await bus.emit(EndpointRemoved(model=MODEL, engine_id="burst-a", reason="killed"))
        await bus.emit(EndpointAdded(model=MODEL, engine_id="burst-b", url=b.url, predecessor_id="burst-a"))
        results = await asyncio.gather(*first, *second)
    for p, lines in zip(prompts * 3, results, strict=True):
        assert_one_complete_stream(lines, expected[p])
    stats = router.stats()
    assert stats["requests"] == 18 and stats["completed"] == 18
    assert stats["failed"] == 0 and stats["cancelled"] == 0 and stats["in_flight"] == 0
    assert stats["replayed"] >= 1
