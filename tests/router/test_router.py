"""The router with real NATS, etcd, engine processes and a router process: routing from events and the
etcd snapshot, replay of in-flight streams after a SIGKILL, holding, the queue bound, the timeout, and
catching up with etcd after a NATS outage.

Endpoints are announced as the controller announces them: the etcd record first, then the event."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import httpx

from libs.common import procs
from libs.common.bus import Bus
from libs.common.events import EndpointAdded, EndpointNotRecovered, EndpointRemoved
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


async def announce(bus: Bus, store: Store, engine_id: str, url: str, predecessor_id: str | None = None) -> None:
    """What the controller does when an engine starts serving: write endpoints/<model>/<engine>, emit added."""
    await store.put(f"endpoints/{MODEL}/{engine_id}", url)
    if predecessor_id:
        await store.delete(f"endpoints/{MODEL}/{predecessor_id}")
    await bus.emit(EndpointAdded(model=MODEL, engine_id=engine_id, url=url, predecessor_id=predecessor_id))


async def retire(bus: Bus, store: Store, engine_id: str, reason: str) -> None:
    await store.delete(f"endpoints/{MODEL}/{engine_id}")
    await bus.emit(EndpointRemoved(model=MODEL, engine_id=engine_id, reason=reason))


def wait_for_table(router: Any, engine_ids: set[str]) -> None:
    deadline = time.monotonic() + 60  # a guard against hanging, not a performance figure
    while {e["engine_id"] for e in router.stats()["endpoints"].get(MODEL, [])} != engine_ids:
        assert time.monotonic() < deadline, router.stats()
        time.sleep(0.05)


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
    stats = router.stats()
    assert stats["completed"] == 1
    # its start-up heap is out of the collector's walks (a full collection held its loop 20-40 ms at a kill)
    assert stats["gc_frozen"] > 10_000 and stats["gc_paused_ms"] >= 0


async def a_stream_cut_by_a_sigkill_resumes_on_the_successor(a: Any, b: Any, start_router: Any, bus: Bus,
                                                           store: Store) -> None:
    """The case, for any engine `a` and successor `b` (started, not yet ready): the router's stream through a's
    SIGKILL completes on b with the tokens of b's uninterrupted run (tests/engine runs it on the reference engine)."""
    await asyncio.gather(asyncio.to_thread(a.wait_ready), asyncio.to_thread(b.wait_ready))
    router = start_router()
    await announce(bus, store, a.engine_id, a.url)
    body = {"prompt": "The memory outlives the engine.", "max_tokens": 400, "ignore_eos": True}
    expected = generate(b.url, **body)["tokens"]

    seen = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as c:
        task = asyncio.create_task(stream_lines(c, router.url, body, seen, after=20))
        await seen.wait()
        a.child.kill(signal.SIGKILL)  # mid-generation: 20 of 400 tokens are out
        await retire(bus, store, a.engine_id, "killed")
        await announce(bus, store, b.engine_id, b.url, predecessor_id=a.engine_id)
        lines = await task
    assert_one_complete_stream(lines, expected)
    assert lines[-1]["replays"] >= 1 and lines[-1]["engines"][-1] == b.engine_id
    stats = router.stats()
    assert stats["replayed"] >= 1 and stats["failed"] == 0 and stats["completed"] == 1


async def test_a_stream_cut_by_a_sigkill_resumes_on_the_successor_and_equals_the_uninterrupted_output(
        engines, start_router, bus: Bus, store: Store) -> None:
    await a_stream_cut_by_a_sigkill_resumes_on_the_successor(engines("kill-a"), engines("kill-b"), start_router,
                                                             bus, store)


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


async def test_a_router_stopped_by_sigterm_exits_0_and_logs_no_error(start_router, tmp_path) -> None:
    """A stop is no failure: its log holds no traceback and no ERROR line (uvicorn's lifespan, cancelled at
    shutdown, logged one on every stop)."""
    router = start_router()
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.get(router.url + "/healthz")).status_code == 200
    assert router.child.stop() == 0
    log = (tmp_path / "router.log").read_text()
    assert "Traceback" not in log and "ERROR" not in log, log


async def test_a_held_request_completes_once_an_endpoint_for_its_model_is_added(engines, start_router, bus: Bus,
                                                                                store: Store) -> None:
    a = engines("late-a")
    router = start_router(hold_timeout_s=60)
    async with httpx.AsyncClient(timeout=90) as c:
        pending = asyncio.create_task(c.post(router.url + "/v1/generate",
                                             json={"model": MODEL, "prompt": "late", "max_tokens": 5}))
        await asyncio.to_thread(wait_until_held, router, 1)
        await asyncio.to_thread(a.wait_ready)
        await announce(bus, store, "late-a", a.url)
        r = await pending
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == generate(a.url, prompt="late", max_tokens=5)["tokens"]
    # the route-in's own timeline: published, received, first request sent and answered, in that order
    entry = next(e for e in router.stats()["route_ins"] if e["engine_id"] == "late-a")
    assert entry["published"] <= entry["received"] <= entry["first_sent"] <= entry["first_answered"]


async def test_no_request_is_dropped_under_a_burst_while_the_engine_is_killed(engines, start_router, bus: Bus,
                                                                              store: Store) -> None:
    a, b = engines("burst-a"), engines("burst-b")
    await asyncio.gather(asyncio.to_thread(a.wait_ready), asyncio.to_thread(b.wait_ready))
    router = start_router(hold_timeout_s=30)
    await announce(bus, store, "burst-a", a.url)
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
        await retire(bus, store, "burst-a", "killed")
        await announce(bus, store, "burst-b", b.url, predecessor_id="burst-a")
        results = await asyncio.gather(*first, *second)
    for p, lines in zip(prompts * 3, results, strict=True):
        assert_one_complete_stream(lines, expected[p])
    stats = router.stats()
    assert stats["requests"] == 18 and stats["completed"] == 18
    assert stats["failed"] == 0 and stats["cancelled"] == 0 and stats["in_flight"] == 0
    assert stats["replayed"] >= 1


async def routed_to(router: Any, prompt: str) -> list[str]:
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(router.url + "/v1/generate", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.json()["engines"]


async def test_after_a_nats_outage_the_router_routes_to_the_endpoint_added_in_etcd_and_not_the_removed_one(
        engines, start_router, store: Store, tmp_path, nats_conf) -> None:
    port = procs.free_port()
    nats = procs.nats_server(port, tmp_path / "own-nats", tmp_path / "own-nats.log", config=nats_conf).start()
    procs.wait_port(port, nats)
    try:
        a, b = engines("cut-a"), engines("cut-b")
        await asyncio.gather(asyncio.to_thread(a.wait_ready), asyncio.to_thread(b.wait_ready))
        await store.put(f"endpoints/{MODEL}/cut-a", a.url)
        # No periodic pass within the test: only the reconnect can bring the table up to date.
        router = start_router(nats_url=f"nats://127.0.0.1:{port}", reconcile_s=3600)
        assert await routed_to(router, "before") == ["cut-a"]

        nats.stop()
        # While the router is cut off: the controller moves the model to cut-b. The events are lost (and
        # here not even published); cut-a stays up, so routing to it would still succeed.
        await store.delete(f"endpoints/{MODEL}/cut-a")
        await store.put(f"endpoints/{MODEL}/cut-b", b.url)
        assert [e["engine_id"] for e in router.stats()["endpoints"][MODEL]] == ["cut-a"]

        nats = procs.nats_server(port, tmp_path / "own-nats", tmp_path / "own-nats.log", config=nats_conf).start()
        procs.wait_port(port, nats)
        await asyncio.to_thread(wait_for_table, router, {"cut-b"})
        for i in range(4):
            assert await routed_to(router, f"after {i}") == ["cut-b"]
        sync = router.stats()["sync"]
        assert sync["reconnects"] >= 1 and sync["last_reason"] == "reconnect"
        assert sync["added"] == 1 and sync["removed"] == 1
        assert a.child.alive()
    finally:
        nats.stop()


async def test_an_endpoint_changed_in_etcd_without_any_event_is_picked_up_by_the_periodic_reconcile(
        engines, start_router, store: Store) -> None:
    a, b = engines("lvl-a"), engines("lvl-b")
    await asyncio.gather(asyncio.to_thread(a.wait_ready), asyncio.to_thread(b.wait_ready))
    router = start_router(reconcile_s=0.2, reconcile_grace_s=0)
    await store.put(f"endpoints/{MODEL}/lvl-a", a.url)
    await asyncio.to_thread(wait_for_table, router, {"lvl-a"})
    assert await routed_to(router, "first") == ["lvl-a"]
    await store.delete(f"endpoints/{MODEL}/lvl-a")
    await store.put(f"endpoints/{MODEL}/lvl-b", b.url)
    await asyncio.to_thread(wait_for_table, router, {"lvl-b"})
    assert await routed_to(router, "second") == ["lvl-b"]
    sync = router.stats()["sync"]
    assert sync["reconnects"] == 0 and sync["last_reason"] == "periodic" and sync["errors"] == 0


async def test_requests_held_for_a_recovery_outlive_the_hold_and_leave_when_their_client_goes(
        engines, start_router, bus: Bus, store: Store) -> None:
    """An incident's route-out (`recovery`) holds the model's requests past `hold_timeout_s` until its successor's
    route-in; a held request whose client goes away leaves the queue at once; an incident that ends without a
    successor (`endpoint.unrecovered`) releases what it held (services/router/table.py, invariant 2)."""
    b = engines("rec-b")
    router = start_router(hold_timeout_s=0.5)
    await store.put(f"endpoints/{MODEL}/rec-a", "http://127.0.0.1:9")
    await bus.emit(EndpointAdded(model=MODEL, engine_id="rec-a", url="http://127.0.0.1:9"))
    await asyncio.to_thread(wait_for_table, router, {"rec-a"})
    await store.delete(f"endpoints/{MODEL}/rec-a")
    await bus.emit(EndpointRemoved(model=MODEL, engine_id="rec-a", reason="killed", incident_id="inc-1", recovery=True))
    await asyncio.to_thread(wait_for_table, router, set())
    body = {"model": MODEL, "prompt": "held through a recovery", "max_tokens": 5}
    async with httpx.AsyncClient(timeout=90) as c, httpx.AsyncClient(timeout=90) as leaver:
        kept = asyncio.create_task(c.post(router.url + "/v1/generate", json=body))
        gone = asyncio.create_task(leaver.post(router.url + "/v1/generate", json=body))
        await asyncio.to_thread(wait_until_held, router, 2)
        await asyncio.sleep(1.5)  # three times the router's own hold
        stats = router.stats()
        assert not kept.done() and list(stats["recoveries"][MODEL]) == ["inc-1"] and stats["held"] == 2
        gone.cancel()
        await leaver.aclose()  # the client goes away: its connection closes
        await asyncio.to_thread(wait_until_held, router, 1)
        await asyncio.to_thread(b.wait_ready)
        await store.put(f"endpoints/{MODEL}/rec-b", b.url)
        await bus.emit(EndpointAdded(model=MODEL, engine_id="rec-b", url=b.url, incident_id="inc-1",
                                     predecessor_id="rec-a"))
        r = await kept
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == generate(b.url, prompt=body["prompt"], max_tokens=5)["tokens"]
        stats = router.stats()
        assert stats["recoveries"] == {} and stats["held"] == 0 and stats["cancelled"] == 1

        # an incident that fails: what it held gets 503 as soon as the router hears it, not at the bound
        await store.delete(f"endpoints/{MODEL}/rec-b")
        await bus.emit(EndpointRemoved(model=MODEL, engine_id="rec-b", reason="killed", incident_id="inc-2",
                                       recovery=True))
        await asyncio.to_thread(wait_for_table, router, set())
        failing = asyncio.create_task(c.post(router.url + "/v1/generate", json=body))
        await asyncio.to_thread(wait_until_held, router, 1)
        await asyncio.sleep(1.0)
        assert not failing.done()
        await bus.emit(EndpointNotRecovered(model=MODEL, engine_id="rec-b", incident_id="inc-2", reason="test"))
        r = await asyncio.wait_for(failing, 30)  # the bound is the router's recovery_hold_s, 300 s
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_endpoint", r.text
    assert router.stats()["recoveries"] == {}


async def test_a_router_started_during_a_recovery_holds_the_model_instead_of_not_knowing_it(
        engines, start_router, bus: Bus, store: Store) -> None:
    """A router that starts while an incident brings a successor in (its `recoveries/` record in etcd, the endpoint
    gone, the route-out's event long sent) holds the model's requests past `hold_timeout_s` until the route-in,
    where a router that never saw the model would answer the OpenAI API's 404. A record the router saw end is not
    taken up again by its reconciles (services/router/sync.py)."""
    b = engines("mark-b")
    await store.put("recoveries/inc-9", json.dumps({"model": MODEL, "at": time.time()}))
    router = start_router(hold_timeout_s=0.5, reconcile_s=0.3)
    assert list(router.stats()["recoveries"][MODEL]) == ["inc-9"]
    body = {"model": MODEL, "prompt": "held by a router that started late", "max_tokens": 5}
    async with httpx.AsyncClient(timeout=90) as c:
        unknown = await c.post(router.url + "/v1/completions", json={**body, "model": "never-served"})
        assert unknown.status_code == 404, unknown.text
        held = asyncio.create_task(c.post(router.url + "/v1/completions", json=body))
        await asyncio.to_thread(wait_until_held, router, 1)
        await asyncio.sleep(1.5)  # three times the router's own hold
        assert not held.done()
        await asyncio.to_thread(b.wait_ready)
        await store.put(f"endpoints/{MODEL}/mark-b", b.url)
        await bus.emit(EndpointAdded(model=MODEL, engine_id="mark-b", url=b.url, incident_id="inc-9"))
        r = await held
        assert r.status_code == 200, r.text
        assert 1 <= r.json()["usage"]["completion_tokens"] <= 5
    await asyncio.sleep(1.0)  # three reconciles read the record whose deletion never came
    assert router.stats()["recoveries"] == {}
