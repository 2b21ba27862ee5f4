"""Reconciling the endpoint table with etcd's level (pure logic: a fake clock, reads from a dict)."""

from __future__ import annotations

import json

import httpx

from libs.common.events import EndpointAdded, EndpointNotRecovered, EndpointRemoved
from services.router.relay import Relay
from services.router.settings import RouterSettings
from services.router.sync import EndpointFeed, Level, parse_endpoints, parse_recoveries, plan
from services.router.table import EndpointTable
from tests.support import Clock


def records(**urls: str) -> dict[str, bytes]:
    """etcd records as the controller writes them: the value is the url, as text."""
    return {f"endpoints/m/{engine}": url.encode() for engine, url in urls.items()}


def make_feed(grace_s: float = 5.0) -> tuple[EndpointFeed, EndpointTable, Relay, Clock]:
    clock = Clock()
    table = EndpointTable(8, clock=clock)
    relay = Relay(table, httpx.AsyncClient(), RouterSettings())
    feed = EndpointFeed(table, relay, grace_s=grace_s, clock=clock, wall=lambda: 1_000_000.0)
    feed.go_live()
    return feed, table, relay, clock


def reader(kvs: dict[str, bytes]):  # noqa: ANN201 - an async callable returning kvs
    async def read() -> dict[str, bytes]:
        return dict(kvs)
    return read


def level(revisions: dict[str, int], **urls: str) -> Level:
    """etcd's level with each endpoint record's mod revision (`revisions` by engine id)."""
    return Level(records(**urls), {f"endpoints/m/{engine}": revisions[engine] for engine in urls})


def level_reader(lvl: Level):  # noqa: ANN201 - an async callable returning a level
    async def read() -> Level:
        return lvl
    return read


def test_endpoint_records_are_read_as_the_controller_writes_them_as_json_strings_and_as_objects_with_a_url() -> None:
    kvs = {
        "endpoints/m/a": b"http://127.0.0.1:1/",
        "endpoints/m/quoted": b'"http://127.0.0.1:4"',
        "endpoints/m/b": json.dumps({"url": "http://127.0.0.1:2", "model": "m"}).encode(),
        "endpoints/org/m2/c": b'"http://127.0.0.1:3"',  # a model name with a slash
        "endpoints/m/bad": b"{not json",
        "endpoints/m/word": b"hello",
        "endpoints/m/nourl": b"{}",
    }
    assert parse_endpoints(kvs) == {("m", "a"): "http://127.0.0.1:1", ("m", "b"): "http://127.0.0.1:2",
                                    ("m", "quoted"): "http://127.0.0.1:4",
                                    ("org/m2", "c"): "http://127.0.0.1:3"}


def test_the_plan_adds_what_etcd_has_removes_what_it_lacks_and_leaves_recent_events_alone() -> None:
    current = {("m", "old"): "http://o", ("m", "keep"): "http://k", ("m", "fresh"): "http://f"}
    desired = {("m", "keep"): "http://k", ("m", "new"): "http://n", ("m", "just-removed"): "http://r"}
    last_event = {("m", "fresh"): 50.0, ("m", "just-removed"): 50.0, ("m", "old"): 10.0}
    p = plan(current, desired, last_event, since=40.0)
    assert p.add == [("m", "new", "http://n")]
    assert p.remove == [("m", "old")]


async def test_a_reconcile_replaces_a_missed_removal_and_addition_without_touching_the_others() -> None:
    feed, table, relay, clock = make_feed()
    feed.load_snapshot(records(a="http://a", keep="http://k"))
    kept = table.pick("m")
    kept2 = table.pick("m")
    busy = {kept.engine_id: kept, kept2.engine_id: kept2}
    cut_a = relay.inflight.add("a")
    cut_keep = relay.inflight.add("keep")

    clock.now += 60  # events about a and b were missed long ago
    table.suspect(busy["keep"], 30)  # the relay saw keep fail a moment ago: a reconcile must not clear that
    assert await feed.reconcile(reader(records(keep="http://k", b="http://b")), "reconnect")
    assert set(table.models["m"].endpoints) == {"keep", "b"}
    assert cut_a.is_set()  # a's streams resume elsewhere, as on endpoint.removed
    assert not cut_keep.is_set()
    keep = table.models["m"].endpoints["keep"]
    assert keep is busy["keep"] and keep.inflight == 1 and keep.suspect_until > clock.now
    assert feed.stats.added == 1 and feed.stats.removed == 1 and feed.stats.last_reason == "reconnect"


async def test_an_event_newer_than_the_grace_outranks_a_lagging_etcd_read_and_etcd_wins_after_it() -> None:
    feed, table, _, clock = make_feed(grace_s=5.0)
    feed.load_snapshot(records(gone="http://g"))
    feed.apply(EndpointAdded(model="m", engine_id="new", url="http://n"))
    feed.apply(EndpointRemoved(model="m", engine_id="gone"))
    lagging = reader(records(gone="http://g"))  # the controller's write-behind has not landed yet

    clock.now += 1
    await feed.reconcile(lagging, "periodic")
    assert set(table.models["m"].endpoints) == {"new"}

    clock.now += 10  # past the grace: what etcd says now is the truth
    await feed.reconcile(lagging, "periodic")
    assert set(table.models["m"].endpoints) == {"gone"}
    assert feed.last_event == {}


async def test_a_failed_read_keeps_the_table_and_is_counted() -> None:
    feed, table, _, clock = make_feed()
    feed.load_snapshot(records(a="http://a"))

    async def broken() -> dict[str, bytes]:
        raise ConnectionError("etcd is away")

    clock.now += 60
    assert not await feed.reconcile(broken, "periodic")
    assert set(table.models["m"].endpoints) == {"a"}
    assert feed.stats.errors == 1 and feed.stats.reconciles == 0


def removed_with_successor(engine_id: str, successor: str, url: str) -> EndpointRemoved:
    return EndpointRemoved(model="m", engine_id=engine_id, reason="sigkill", successor_id=successor, successor_url=url)


async def test_a_likely_successor_named_by_the_removal_is_routed_to_at_once_and_its_addition_keeps_its_streams() -> None:
    feed, table, relay, clock = make_feed()
    feed.load_snapshot(records(dead="http://d"))
    feed.apply(removed_with_successor("dead", "sb", "http://sb/"))
    ep = table.pick("m")  # a resumed request goes to the standby while it takes over
    assert ep is not None and ep.engine_id == "sb" and ep.url == "http://sb" and ep.promised
    stream = relay.inflight.add("sb")

    clock.now += 0.05
    feed.apply(EndpointAdded(model="m", engine_id="sb", url="http://sb", predecessor_id="dead"))
    assert not stream.is_set()  # the promise kept: the stream already on its way goes on
    same = table.models["m"].endpoints["sb"]
    assert same is ep and not same.promised and same.inflight == 1
    assert feed.promised == {}
    route_in = relay.route_ins.recent()[-1]
    assert route_in["engine_id"] == "sb" and route_in["promised"] <= route_in["received"]


async def test_another_successors_addition_voids_the_promise_and_its_streams_resume_there() -> None:
    feed, table, relay, clock = make_feed()
    feed.load_snapshot(records(dead="http://d"))
    feed.apply(removed_with_successor("dead", "sb", "http://sb"))
    stream = relay.inflight.add("sb")
    feed.apply(EndpointAdded(model="m", engine_id="cold", url="http://c", predecessor_id="dead"))
    assert stream.is_set()  # cut: it resumes on the successor that did take over
    assert set(table.models["m"].endpoints) == {"cold"}


async def test_a_promise_that_etcd_never_confirms_is_removed_after_the_grace() -> None:
    feed, table, relay, clock = make_feed(grace_s=5.0)
    feed.load_snapshot(records(dead="http://d"))
    feed.apply(removed_with_successor("dead", "sb", "http://sb"))
    stream = relay.inflight.add("sb")
    clock.now += 1
    await feed.reconcile(reader({}), "periodic")
    assert "sb" in table.models["m"].endpoints and not stream.is_set()  # within the grace: the takeover may yet end
    clock.now += 10
    await feed.reconcile(reader({}), "periodic")
    assert table.models["m"].endpoints == {} and stream.is_set() and feed.promised == {}


async def test_a_removal_naming_an_endpoint_already_serving_changes_nothing_of_it() -> None:
    feed, table, _, _ = make_feed()
    feed.load_snapshot(records(dead="http://d", live="http://l"))
    live = table.models["m"].endpoints["live"]
    live.inflight = 3
    feed.apply(removed_with_successor("dead", "live", "http://elsewhere"))
    assert table.models["m"].endpoints == {"live": live} and live.url == "http://l" and not live.promised
    assert feed.promised == {}


def marker(model: str, age_s: float) -> bytes:
    """A recovery record as the controller writes it, its route-out `age_s` before the feed's wall clock."""
    return json.dumps({"model": model, "at": 1_000_000.0 - age_s}).encode()


def test_recovery_records_are_read_apart_from_endpoints_and_malformed_ones_skipped() -> None:
    kvs = {**records(a="http://a"), "recoveries/inc-1": marker("m", 3), "recoveries/inc-2": b"{not json",
           "recoveries/inc-3": b'{"model": 5, "at": 1}', "recoveries/": marker("m", 1)}
    assert parse_endpoints(kvs) == {("m", "a"): "http://a"}
    assert parse_recoveries(kvs) == {"inc-1": ("m", 999_997.0)}


async def test_a_router_starting_during_a_recovery_holds_its_model_for_what_is_left_of_the_bound() -> None:
    feed, table, _, _ = make_feed()
    feed.load_snapshot({"recoveries/inc-1": marker("m", 100.0), "recoveries/inc-old": marker("m", 400.0)})
    assert table.recoveries() == {"m": {"inc-1": 200.0}}  # hold 300 s from the route-out; the old one is past it
    assert table.is_known("m")  # held, not "model not found"
    feed.apply(EndpointAdded(model="m", engine_id="b", url="http://b", incident_id="inc-1"))
    assert table.recoveries() == {}


async def test_a_reconcile_starts_a_missed_recovery_but_never_one_this_router_saw_end() -> None:
    feed, table, _, clock = make_feed()
    feed.apply(EndpointRemoved(model="m", engine_id="a", reason="killed", incident_id="inc-1", recovery=True))
    feed.apply(EndpointAdded(model="m", engine_id="b", url="http://b", incident_id="inc-1"))  # ended
    kvs = {**records(b="http://b"), "recoveries/inc-1": marker("m", 1.0),  # its deletion not landed yet
           "recoveries/inc-2": marker("m2", 1.0)}  # another incident's route-out this router missed
    assert await feed.reconcile(reader(kvs), "periodic")
    assert table.recoveries() == {"m2": {"inc-2": 299.0}}
    clock.now += 10.0
    assert await feed.reconcile(reader(kvs), "periodic")  # a renewed read does not extend the bound
    assert table.recoveries() == {"m2": {"inc-2": 289.0}}


async def test_a_sound_engines_removal_takes_no_new_request_but_its_streams_run_until_its_successor_is_routed_in() -> None:
    feed, table, relay, clock = make_feed()
    feed.load_snapshot(records(old="http://o", other="http://x"))
    regrouped, kept = relay.inflight.add("old"), relay.inflight.add("other")
    feed.apply(EndpointRemoved(model="m", engine_id="old", reason="regroup", incident_id="rg-1", recovery=True,
                               live=True))
    assert set(table.models["m"].endpoints) == {"other"}  # no new request goes to it
    assert not regrouped.is_set()  # its stream runs on: its sequence stays in its journal and its KV backup
    clock.now += 10
    assert await feed.reconcile(reader(records(other="http://x")), "periodic")  # etcd agrees it is gone
    assert not regrouped.is_set()
    feed.apply(EndpointAdded(model="m", engine_id="new", url="http://n", incident_id="rg-1", predecessor_id="old"))
    assert regrouped.is_set() and not kept.is_set()  # its successor serves: the stream resumes there
    assert feed.lingering == {}


async def test_a_lingering_stream_is_cut_when_the_recovery_ends_without_a_successor_or_past_the_bound() -> None:
    feed, _, relay, clock = make_feed()
    feed.load_snapshot(records(a="http://a", b="http://b"))
    on_a, on_b = relay.inflight.add("a"), relay.inflight.add("b")
    feed.apply(EndpointRemoved(model="m", engine_id="a", incident_id="i-a", recovery=True, live=True))
    feed.apply(EndpointRemoved(model="m", engine_id="b", incident_id="i-b", recovery=True, live=True))
    feed.apply(EndpointNotRecovered(model="m", engine_id="a", incident_id="i-a", reason="no placement"))
    assert on_a.is_set() and not on_b.is_set()
    clock.now += feed.recovery_hold_s - 1
    assert await feed.reconcile(reader({}), "periodic")
    assert not on_b.is_set()
    clock.now += 2  # past the bound with no word of its end: cut, as a failed engine's are at once
    assert await feed.reconcile(reader({}), "periodic")
    assert on_b.is_set() and feed.lingering == {}


async def test_a_lingering_engine_routed_to_again_keeps_its_streams_past_the_bound() -> None:
    feed, table, relay, clock = make_feed()
    feed.load_snapshot(records(a="http://a"))
    stream = relay.inflight.add("a")
    feed.apply(EndpointRemoved(model="m", engine_id="a", incident_id="i", recovery=True, live=True))
    feed.apply(EndpointAdded(model="m", engine_id="a", url="http://a"))  # its recovery failed: it serves on
    assert "a" in table.models["m"].endpoints and feed.lingering == {}
    clock.now += feed.recovery_hold_s + 1
    assert await feed.reconcile(reader(records(a="http://a")), "periodic")
    assert not stream.is_set()


async def test_a_failed_engines_removal_cuts_its_streams_at_once() -> None:
    feed, _, relay, _ = make_feed()
    feed.load_snapshot(records(a="http://a"))
    stream = relay.inflight.add("a")
    feed.apply(EndpointRemoved(model="m", engine_id="a", reason="hung", incident_id="i", recovery=True))
    assert stream.is_set() and feed.lingering == {}


async def test_a_stale_etcd_neither_revives_a_dead_engine_nor_drops_its_promised_standby() -> None:
    """etcd died just after an engine's SIGKILL: the route-out reached the router, the controller's delete of the dead
    engine's record never landed, and etcd came back past the grace with the old level. The reconcile routed to the
    dead engine again and removed the standby the held requests were promised to: every stream failed (probe of
    2026-12-07)."""
    feed, table, relay, clock = make_feed(grace_s=5.0)
    feed.load_snapshot(level({"dead": 7}, dead="http://d"))
    feed.apply(removed_with_successor("dead", "sb", "http://sb"))
    stream = relay.inflight.add("sb")
    clock.now += 20  # etcd away meanwhile; back with the level of before the death
    assert await feed.reconcile(level_reader(level({"dead": 7}, dead="http://d")), "periodic")
    assert set(table.models["m"].endpoints) == {"sb"} and not stream.is_set()
    clock.now += 20
    assert await feed.reconcile(level_reader(level({"dead": 7}, dead="http://d")), "periodic")  # still stale
    assert set(table.models["m"].endpoints) == {"sb"} and table.models["m"].endpoints["sb"].promised
    feed.apply(EndpointAdded(model="m", engine_id="sb", url="http://sb", predecessor_id="dead"))  # the new leader
    clock.now += 20
    assert await feed.reconcile(level_reader(level({"sb": 9}, sb="http://sb")), "periodic")
    assert set(table.models["m"].endpoints) == {"sb"} and not stream.is_set() and feed.promised == {}


async def test_a_removed_engines_record_written_again_after_its_removal_routes_to_it_again() -> None:
    feed, table, _, clock = make_feed(grace_s=5.0)
    feed.load_snapshot(level({"a": 3}, a="http://a"))
    feed.apply(EndpointRemoved(model="m", engine_id="a", reason="sigkill"))
    clock.now += 10
    assert await feed.reconcile(level_reader(level({"a": 3}, a="http://a")), "periodic")
    assert table.models.get("m") is None or "a" not in table.models["m"].endpoints
    clock.now += 10  # the controller routed it in again; its event was missed
    assert await feed.reconcile(level_reader(level({"a": 12}, a="http://a")), "periodic")
    assert set(table.models["m"].endpoints) == {"a"}


async def test_a_promise_outlives_the_grace_while_its_predecessor_is_recorded_up_to_the_recovery_hold() -> None:
    feed, table, _, clock = make_feed(grace_s=5.0)
    feed.recovery_hold_s = 60.0
    feed.load_snapshot(level({"dead": 4}, dead="http://d"))
    feed.apply(removed_with_successor("dead", "sb", "http://sb"))
    clock.now += 30
    assert await feed.reconcile(level_reader(level({"dead": 4}, dead="http://d")), "periodic")
    assert set(table.models["m"].endpoints) == {"sb"}
    clock.now += 40  # past the hold: no word of the incident's end, etcd's level wins
    assert await feed.reconcile(level_reader(level({"dead": 4}, dead="http://d")), "periodic")
    assert table.models.get("m") is None or "sb" not in table.models["m"].endpoints


async def test_a_successor_routed_in_while_etcd_was_away_stays_until_etcd_catches_up() -> None:
    """etcd stopped just after the kill: the takeover ended and its route-in event came, but the controller's put of
    the successor (and delete of the dead engine) never landed; its next term came 15 s after etcd was back. The
    reconcile took the successor for "gone from etcd" and its streams failed (probe of 2026-12-07)."""
    feed, table, relay, clock = make_feed(grace_s=5.0)
    feed.load_snapshot(level({"dead": 5}, dead="http://d"))
    feed.apply(EndpointRemoved(model="m", engine_id="dead", reason="sigkill"))
    feed.apply(EndpointAdded(model="m", engine_id="sb", url="http://sb", predecessor_id="dead"))
    stream = relay.inflight.add("sb")
    clock.now += 20
    assert await feed.reconcile(level_reader(level({"dead": 5}, dead="http://d")), "periodic")  # stale
    assert set(table.models["m"].endpoints) == {"sb"} and not stream.is_set()
    clock.now += 20
    assert await feed.reconcile(level_reader(level({"sb": 8}, sb="http://sb")), "periodic")  # caught up
    assert set(table.models["m"].endpoints) == {"sb"} and feed.routed_in == {}


async def test_a_routed_in_successor_is_kept_though_the_route_outs_delete_landed_and_left_once_etcd_showed_it() -> None:
    feed, table, relay, clock = make_feed(grace_s=5.0)
    feed.load_snapshot(level({"dead": 5}, dead="http://d"))
    feed.apply(EndpointRemoved(model="m", engine_id="dead", reason="sigkill"))
    feed.apply(EndpointAdded(model="m", engine_id="sb", url="http://sb", predecessor_id="dead"))
    clock.now += 20  # the route-out's delete landed, then etcd stopped before the successor's put
    assert await feed.reconcile(level_reader(level({})), "periodic")
    assert set(table.models["m"].endpoints) == {"sb"}
    clock.now += 20
    assert await feed.reconcile(level_reader(level({"sb": 9}, sb="http://sb")), "periodic")  # shown: plain now
    clock.now += 20  # removed since, its event missed: etcd's word
    assert await feed.reconcile(level_reader(level({})), "periodic")
    assert table.models.get("m") is None or "sb" not in table.models["m"].endpoints


async def test_an_incidents_end_without_a_successor_withdraws_its_promise() -> None:
    """The standby promised would never serve; with etcd stale it kept the model's requests, each answered 503 by it
    after its hold, for up to `recovery_hold_s` (review of 2026-12-07)."""
    feed, table, relay, clock = make_feed(grace_s=5.0)
    feed.load_snapshot(level({"dead": 5}, dead="http://d"))
    feed.apply(removed_with_successor("dead", "sb", "http://sb"))
    stream = relay.inflight.add("sb")
    feed.apply(EndpointNotRecovered(model="m", engine_id="dead", incident_id="inc-1", reason="no room"))
    assert stream.is_set() and feed.promised == {}
    assert table.models.get("m") is None or "sb" not in table.models["m"].endpoints
