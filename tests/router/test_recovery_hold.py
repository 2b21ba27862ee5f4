"""A request is held while an incident recovers its model's endpoint (router table.py, invariant 2): past its own
hold while the successor starts, given up at once when the incident ends without one, bounded when the end is
missed. The table and the event feed, on the real event loop and clock (short waits), no I/O."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from libs.common.events import EndpointAdded, EndpointNotRecovered, EndpointRemoved
from services.router.relay import Relay
from services.router.settings import RouterSettings
from services.router.sync import EndpointFeed
from services.router.table import EndpointTable, NoEndpoint
from tests.support import Clock

OWN_WAIT_S = 0.05  # the request's own hold: far below how long each recovery below takes


async def started(task: asyncio.Task[object], table: EndpointTable, held: int = 1) -> None:
    while table.held() < held:
        await asyncio.sleep(0.001)
    assert not task.done()


async def test_a_held_request_waits_past_its_own_hold_for_the_successor_of_a_recovery() -> None:
    t = EndpointTable(4)
    t.recovering("m", "inc-1", 30.0)
    held = asyncio.create_task(t.acquire("m", OWN_WAIT_S))
    replay = asyncio.create_task(t.acquire("m", OWN_WAIT_S, admitted=True))  # a cut stream's resumption too
    await started(held, t)
    await asyncio.sleep(OWN_WAIT_S * 6)
    assert not held.done() and not replay.done()  # its own hold is long past
    t.add("m", "succ", "http://succ")
    t.recovered("inc-1")
    assert (await held).engine_id == "succ" and (await replay).engine_id == "succ"
    assert t.held() == 0 and t.recoveries() == {}


async def test_an_incident_that_ends_without_a_successor_releases_its_held_requests_at_once() -> None:
    t = EndpointTable(4)
    t.recovering("m", "inc-1", 30.0)
    held = asyncio.create_task(t.acquire("m", OWN_WAIT_S))
    await started(held, t)
    await asyncio.sleep(OWN_WAIT_S * 2)
    t.recovered("inc-1")
    with pytest.raises(NoEndpoint, match="after waiting"):
        await asyncio.wait_for(held, 5)  # not the recovery's 30 s
    assert t.held() == 0


async def test_a_request_within_its_own_hold_keeps_waiting_when_a_recovery_ends() -> None:
    t = EndpointTable(4)
    t.recovering("m", "inc-1", 30.0)
    held = asyncio.create_task(t.acquire("m", 30.0))
    await started(held, t)
    t.recovered("inc-1")
    await asyncio.sleep(0.05)
    assert not held.done()
    t.add("m", "other", "http://other")
    assert (await held).engine_id == "other"


async def test_a_recovery_whose_end_is_missed_holds_requests_no_longer_than_its_bound() -> None:
    t = EndpointTable(4)
    t.recovering("m", "inc-1", OWN_WAIT_S * 4)
    with pytest.raises(NoEndpoint):
        await asyncio.wait_for(t.acquire("m", OWN_WAIT_S), 5)
    assert t.recoveries() == {}  # expired: forgotten


async def test_of_two_recoveries_of_one_model_the_later_bound_holds_until_both_end() -> None:
    t = EndpointTable(4)
    t.recovering("m", "inc-1", 30.0)
    t.recovering("m", "inc-2", 30.0)
    t.recovering("n", "inc-3", 30.0)  # another model's recovery holds nothing of m's
    held = asyncio.create_task(t.acquire("m", OWN_WAIT_S))
    await started(held, t)
    t.recovered("inc-1")
    await asyncio.sleep(OWN_WAIT_S * 3)
    assert not held.done()
    assert set(t.recoveries()) == {"m", "n"} and set(t.recoveries()["m"]) == {"inc-2"}
    t.recovered("inc-2")
    with pytest.raises(NoEndpoint):
        await asyncio.wait_for(held, 5)


async def test_a_held_request_whose_client_goes_leaves_the_queue_at_once() -> None:
    """Its client gone, the HTTP layer cancels the request (libs/common/web/disconnect.py `unless_gone`)."""
    t = EndpointTable(1)
    t.recovering("m", "inc-1", 30.0)
    held = asyncio.create_task(t.acquire("m", OWN_WAIT_S))
    await started(held, t)
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(held, 5)
    assert t.held() == 0
    again = asyncio.create_task(t.acquire("m", 30.0))  # its place in the queue (queue_max 1) is free again
    await started(again, t)
    t.add("m", "succ", "http://succ")
    assert (await again).engine_id == "succ"


def test_a_model_stays_known_while_it_recovers_past_its_forget_time() -> None:
    clock = Clock()
    t = EndpointTable(4, forget_s=60.0, clock=clock)
    t.add("m", "a", "http://a")
    t.recovering("m", "inc-1", 300.0)
    t.remove("m", "a")
    clock.now += 200.0  # a long cold start
    assert t.is_known("m") and t.known() == ["m"]
    t.recovered("inc-1")
    assert not t.is_known("m")


def make_feed() -> tuple[EndpointFeed, EndpointTable]:
    table = EndpointTable(8)
    feed = EndpointFeed(table, Relay(table, httpx.AsyncClient(), RouterSettings()), recovery_hold_s=120.0)
    feed.go_live()
    return feed, table


def removed(engine: str, *, recovery: bool, incident: str | None = "inc-1", reason: str = "killed") -> EndpointRemoved:
    return EndpointRemoved(model="m", engine_id=engine, url=f"http://{engine}", reason=reason, incident_id=incident,
                           recovery=recovery)


def test_an_incidents_route_out_starts_a_recovery_and_its_route_in_ends_it() -> None:
    feed, table = make_feed()
    feed.apply(EndpointAdded(model="m", engine_id="a", url="http://a"))
    feed.apply(removed("a", recovery=True))
    assert set(table.recoveries()["m"]) == {"inc-1"}
    assert 119.0 < table.recoveries()["m"]["inc-1"] <= 120.0  # the feed's recovery_hold_s
    feed.apply(EndpointAdded(model="m", engine_id="b", url="http://b", incident_id="inc-1", predecessor_id="a"))
    assert table.recoveries() == {}


def test_an_incident_that_ends_unrecovered_ends_its_recovery() -> None:
    feed, table = make_feed()
    feed.apply(removed("a", recovery=True))
    feed.apply(EndpointNotRecovered(model="m", engine_id="a", incident_id="inc-1", reason="fallback: no GPU"))
    assert table.recoveries() == {}


def test_removals_that_bring_no_successor_start_no_recovery() -> None:
    feed, table = make_feed()
    feed.apply(removed("a", recovery=False, incident=None, reason="stopped"))  # an engine stopped
    feed.apply(removed("b", recovery=False, reason="drained"))  # a drained engine, after its successor's route-in
    assert table.recoveries() == {}
