"""The router's Prometheus /metrics (issue 24, part 4): requests by outcome, in flight, and the time to first
token move with the requests a real router relays to a real engine."""

from __future__ import annotations

import asyncio

import httpx

from libs.common import procs
from libs.common.store import Store
from services.router.settings import RouterSettings
from tests.scrape import scrape

MODEL = "tiny-ref"


def outcome(m: dict, name: str) -> float:
    return m[("holdfast_router_requests_total", (("outcome", name),))]


async def test_metrics_count_a_completed_and_a_refused_request_and_time_the_first_token(
        engines, start_router, store: Store) -> None:  # noqa: ANN001
    engine = engines("metrics-a")
    await asyncio.to_thread(engine.wait_ready)
    await store.put(f"endpoints/{MODEL}/metrics-a", {"url": engine.url, "model": MODEL})
    port = procs.free_port()
    router = await asyncio.to_thread(start_router, metrics_port=port, hold_timeout_s=0.3)
    before = scrape(port)
    assert outcome(before, "completed") == 0
    assert before[("holdfast_router_time_to_first_token_seconds_count", ())] == 0

    async with httpx.AsyncClient(timeout=30) as c:
        ok = await c.post(router.url + "/v1/generate",
                          json={"model": MODEL, "prompt": "metrics", "max_tokens": 8, "ignore_eos": True})
        refused = await c.post(router.url + "/v1/generate",
                               json={"model": "nobody-serves-this", "prompt": "x", "max_tokens": 4})
    assert (ok.status_code, refused.status_code) == (200, 503)
    after = scrape(port)
    assert outcome(after, "completed") == 1
    assert outcome(after, "failed") == 1
    assert after[("holdfast_router_rejected_total", ())] == 1
    assert after[("holdfast_router_requests_received_total", ())] == 2
    assert after[("holdfast_router_in_flight", ())] == 0
    assert after[("holdfast_router_replays_total", ())] == 0
    # One first token (the refused request never had one), within the request's own duration.
    assert after[("holdfast_router_time_to_first_token_seconds_count", ())] == 1
    assert 0 < after[("holdfast_router_time_to_first_token_seconds_sum", ())] <= ok.elapsed.total_seconds()


def test_metrics_are_off_by_default_and_on_loopback() -> None:
    s = RouterSettings()
    assert (s.metrics_port, s.metrics_host) == (None, "127.0.0.1")
