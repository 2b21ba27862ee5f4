"""The endpoint table's choices (pure logic, a fake clock)."""

from __future__ import annotations

import asyncio

import pytest

from services.router.table import EndpointTable, NoEndpoint, QueueFull
from tests.support import Clock


def test_the_least_loaded_endpoint_is_chosen_and_ties_rotate() -> None:
    t = EndpointTable(4)
    t.add("m", "a", "http://a")
    t.add("m", "b", "http://b")
    first, second = t.pick("m"), t.pick("m")
    assert {first.engine_id, second.engine_id} == {"a", "b"}
    t.release(first)
    assert t.pick("m") is first


def test_a_suspect_endpoint_is_skipped_until_its_time_passes_or_an_event_adds_it_again() -> None:
    clock = Clock()
    t = EndpointTable(4, clock=clock)
    ep = t.add("m", "a", "http://a")
    t.suspect(ep, 5.0)
    assert t.pick("m") is None
    clock.now += 5.0
    assert t.pick("m") is ep
    t.suspect(ep, 5.0)
    t.add("m", "a", "http://a")
    assert t.pick("m") is ep


async def test_held_requests_beyond_the_bound_are_refused_but_admitted_replays_are_not() -> None:
    t = EndpointTable(1)
    held = asyncio.create_task(t.acquire("m", 5.0))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await t.acquire("m", 5.0)
    replay = asyncio.create_task(t.acquire("m", 5.0, admitted=True))
    await asyncio.sleep(0)
    t.add("m", "a", "http://a")
    assert (await held).engine_id == "a" and (await replay).engine_id == "a"
    assert t.held() == 0


async def test_a_held_request_times_out_with_no_endpoint() -> None:
    t = EndpointTable(4)
    with pytest.raises(NoEndpoint):
        await t.acquire("m", 0.05)
    assert t.held() == 0


def test_removing_an_endpoint_takes_it_out_of_every_choice() -> None:
    t = EndpointTable(4)
    t.add("m", "a", "http://a")
    assert t.remove("m", "a") is not None
    assert t.pick("m") is None and t.describe() == {}


async def test_a_model_is_known_while_served_and_for_the_forget_window_after_its_last_endpoint_went() -> None:
    held = EndpointTable(4)
    with pytest.raises(NoEndpoint):
        await held.acquire("held-only", 0.01)  # a request held for a model creates no knowledge of it
    assert held.known() == [] and not held.is_known("held-only")
    clock = Clock()
    t = EndpointTable(4, forget_s=60.0, clock=clock)
    t.add("m", "a", "http://a")
    t.add("m", "b", "http://b")
    t.remove("m", "a")
    clock.now += 1000.0
    assert t.known() == ["m"]  # b still serves it
    t.remove("m", "b")
    clock.now += 59.0
    assert t.is_known("m")  # a failover's gap: requests are held, not refused
    t.add("m", "c", "http://c")
    t.remove("m", "c")
    clock.now += 60.0
    assert not t.is_known("m") and t.known() == []


def test_a_new_request_goes_to_a_serving_endpoint_before_a_promised_one_and_a_replay_to_the_least_loaded() -> None:
    table = EndpointTable(8)
    live = table.add("m", "live", "http://l")
    live.inflight = 5
    table.add("m", "sb", "http://sb", promised=True)
    assert table.pick("m", fresh=True).engine_id == "live"  # type: ignore[union-attr]
    assert table.pick("m").engine_id == "sb"  # type: ignore[union-attr]  # a replay: the successor holds its KV
    table.remove("m", "live")
    assert table.pick("m", fresh=True).engine_id == "sb"  # type: ignore[union-attr]  # none else: it waits there


async def test_names_no_engine_serves_leave_nothing_behind_and_are_held_within_one_bound_together() -> None:
    """Invariants 2 and 6: a client's unknown model names are held within `queue_max` all together (not each), and
    no entry stays once their requests leave; a replay still waiting keeps its model's entry, so an endpoint added
    then wakes it."""
    t = EndpointTable(2)
    for i in range(50):
        with pytest.raises(NoEndpoint):
            await t.acquire(f"nobody-{i}", 0.001)
    assert t.models == {} and t.held() == 0
    held = [asyncio.create_task(t.acquire(f"x{i}", 5.0)) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await t.acquire("x9", 5.0)
    for h in held:
        h.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert t.models == {}
    replay = asyncio.create_task(t.acquire("m", 5.0, admitted=True))
    fresh = asyncio.create_task(t.acquire("m", 0.05))
    with pytest.raises(NoEndpoint):
        await fresh  # the new request gives up; the replay waits on
    t.add("m", "a", "http://a")
    assert (await asyncio.wait_for(replay, 2)).engine_id == "a"
