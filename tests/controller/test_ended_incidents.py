"""An ended incident never changes again, and every incident ends (issue 18, chaos findings of the ninth session).

1. An end is announced (incident.resolved / incident.failed) only once the record saying so is in etcd: a leader
   that loses its term between the two (its fenced write refused, as after an etcd stall) announces nothing, so
   the next leader, resuming from the older record, cannot end, differently, an incident already heard ended.
2. A fallback's own cold-started engine that fails before it is ready fails that fallback at once (its incident
   ends failed), instead of leaving the incident in fallback until its 300 s deadline while the engine's own
   incident (`inc-cs-inc-...`) recovers what it can.

The leader's pipeline runs in this process (`IncidentDriver`), against the session's NATS and etcd, with a fence
(the leader key's stand-in) that the test takes away.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.errors import InvalidTransition
from libs.common.events import (
    EndpointAdded,
    EndpointNotRecovered,
    EngineInfo,
    EngineReady,
    EngineRole,
    Envelope,
    FaultDetected,
    FaultKind,
    IncidentFailed,
    IncidentReason,
    IncidentResolved,
    Step,
    Thaw,
    ThawReply,
)
from libs.common.ids import cold_engine_id
from libs.common.store import Store
from services.controller.incident import (
    TERMINAL,
    TRANSITIONS,
    IncidentRecord,
    IncidentState,
    Trigger,
    can,
    end_step,
    incident_id_for,
    opened_record,
    start_step,
    transition,
)
from services.controller.metrics import ControllerMetrics
from services.controller.pipeline import IncidentDriver
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView
from tests.controller.helpers import wait_for

FENCE = "test/fence"


@pytest.fixture
async def driver(bus: Bus, store: Store, settings: CommonSettings):  # noqa: ANN201 - an async generator fixture
    await store.put(FENCE, "held")
    view = ClusterView()
    conf = ControllerSettings(**settings.model_dump(), instance="c-test", api_enabled=False, record_linger_s=0.0)
    d = IncidentDriver(bus, store, view, conf, ControllerMetrics(view, lambda: True),
                       fence=lambda t: [t.value(store.full(FENCE)) == b"held"])
    yield d
    await d.writer.close()


async def in_fallback_here(driver: IncidentDriver, store: Store, engine_id: str) -> tuple[IncidentRecord, str]:
    """An incident in fallback, held by `driver` and in etcd, its cold engine recorded; and that engine's id."""
    cold = cold_engine_id(incident_id_for(engine_id, 1))
    rec = in_fallback(engine_id, cold)
    await store.put(f"incidents/{rec.id}", rec)
    driver.open.put(rec)
    return rec, cold


def in_fallback(engine_id: str, cold: str | None) -> IncidentRecord:
    rec = opened_record(id=incident_id_for(engine_id, 1), engine_id=engine_id, model="m", node="n1",
                        kind=FaultKind.GPU_FAULT, memory_lost=True)
    rec = rec.model_copy(update={"state": IncidentState.FALLBACK, "fallback": True, "deadline": time.time() + 300,
                                 "cold_successor_id": cold, "cold_successor_node": "n1" if cold else None})
    return rec


async def ends_heard(bus: Bus) -> list[Envelope]:
    return [e for e in await bus.replay("incident.>") if isinstance(e.data, (IncidentResolved, IncidentFailed))]


async def test_an_end_whose_record_the_fence_refuses_is_not_announced(driver: IncidentDriver, bus: Bus,
                                                                      store: Store) -> None:
    rec, cold = await in_fallback_here(driver, store, "e1")
    await store.put(FENCE, "another term")  # this leader's term is over (its lease expired in an etcd stall)
    with pytest.raises(Exception):  # noqa: B017, PT011 - the write's refusal, whatever its type: redelivered
        await driver.trigger(rec.id, Trigger.SPAWNED, states=frozenset({IncidentState.FALLBACK}), successor_id=cold,
                             successor_endpoint="http://127.0.0.1:1")
    await asyncio.sleep(0.3)
    kept = await store.get_model(f"incidents/{rec.id}", IncidentRecord)
    assert kept is not None and kept.state is IncidentState.FALLBACK  # what the next leader resumes from
    assert await ends_heard(bus) == []  # so nobody heard it end: the next leader's end is its only one


async def test_an_end_is_announced_after_its_record_is_written(driver: IncidentDriver, bus: Bus,
                                                               store: Store) -> None:
    rec, cold = await in_fallback_here(driver, store, "e2")
    seen: list[IncidentState | None] = []

    async def on_end(env: Envelope) -> None:  # what etcd says when the end is heard
        if isinstance(env.data, IncidentResolved):
            got = await store.get_model(f"incidents/{rec.id}", IncidentRecord)
            seen.append(got.state if got else None)

    sub = await bus.subscribe("incident.resolved", on_end)
    try:
        await driver.trigger(rec.id, Trigger.SPAWNED, states=frozenset({IncidentState.FALLBACK}), successor_id=cold,
                             successor_endpoint="http://127.0.0.1:1")
        await wait_for(lambda: asyncio.sleep(0, seen), what="incident.resolved heard")
    finally:
        await sub.unsubscribe()
    assert seen == [IncidentState.RESOLVED]


async def test_a_cold_started_engine_failing_before_ready_fails_its_fallback_at_once(
        driver: IncidentDriver, bus: Bus, store: Store) -> None:
    # Its cold start not yet recorded (the fallback's result not in): the engine's name says whose it is.
    rec = in_fallback("e3", None)
    await store.put(f"incidents/{rec.id}", rec)
    driver.open.put(rec)
    cold = cold_engine_id(rec.id)
    fault = FaultDetected(engine_id=cold, model="m", generation=0, kind=FaultKind.EXITED, node="n1")
    out = await driver.on_faults([Envelope(type=fault.type, source="agent", data=fault, node="n1")])
    assert out == [None]

    async def parent_failed() -> IncidentRecord | None:
        got = await store.get_model(f"incidents/{rec.id}", IncidentRecord)
        return got if got is not None and got.state is IncidentState.FAILED else None

    failed = await wait_for(parent_failed, timeout=5.0, what="the fallback's incident failed")
    assert cold in (failed.failure or "")
    child = incident_id_for(cold, 0)  # the engine's own incident opens as usual (its memory may be taken over)
    assert await store.get_model(f"incidents/{child}", IncidentRecord) is not None


def test_no_trigger_moves_an_ended_incident() -> None:
    """The rule in the table itself: whatever arrives late (a result, a redelivered event, a deadline), an incident
    that ended takes it nowhere."""
    for ended in TERMINAL:
        for trigger in Trigger:
            assert not can(ended, trigger)
            with pytest.raises(InvalidTransition, match="never changes again"):
                transition(ended, trigger)
    assert not any(state in TERMINAL for state, _ in TRANSITIONS)


async def fail_routed_out(driver: IncidentDriver, store: Store, rec: IncidentRecord, engine: EngineInfo) -> None:
    """`rec` (in fallback, its engine routed out) held by `driver` and in etcd, `engine` in the view; then its cold
    engine's fault, which fails the fallback at once."""
    start_step(rec, Step.ROUTE_OUT, time.time())
    end_step(rec, Step.ROUTE_OUT, "done", time.time())
    driver.view.engines[engine.engine_id] = engine
    await store.put(f"incidents/{rec.id}", rec)
    driver.open.put(rec)
    fault = FaultDetected(engine_id=cold_engine_id(rec.id), model="m", generation=0, kind=FaultKind.EXITED,
                          node="node-1")
    await driver.on_faults([Envelope(type=fault.type, source="agent", data=fault, node="node-1")])


async def failed_and_heard(store: Store, bus: Bus, recs: list[IncidentRecord]) -> list[IncidentRecord] | None:
    """Each of `recs` failed in etcd and its end announced, in order; else None."""
    got = [await store.get_model(f"incidents/{r.id}", IncidentRecord) for r in recs]
    ended = [g for g in got if g is not None and g.state is IncidentState.FAILED]
    heard = {e.data.incident_id for e in await ends_heard(bus)}
    return ended if len(ended) == len(recs) and heard >= {r.id for r in recs} else None


async def test_a_failed_incident_that_routed_its_engine_out_tells_routers_no_successor_comes(
        driver: IncidentDriver, bus: Bus, store: Store) -> None:
    """Routers hold a model's requests while an incident brings a successor in (its route-out's `recovery`); one that
    ends failed says so (`router.endpoint.unrecovered`), so they stop holding them at once. One that never routed
    its engine out says nothing to routers."""
    rec = in_fallback("routed-out-e4", None)
    start_step(rec, Step.ROUTE_OUT, time.time())
    end_step(rec, Step.ROUTE_OUT, "done", time.time())
    quiet = in_fallback("not-routed-out-e5", None)  # no route-out step
    for r in (rec, quiet):
        await store.put(f"incidents/{r.id}", r)
        driver.open.put(r)
        fault = FaultDetected(engine_id=cold_engine_id(r.id), model="m", generation=0, kind=FaultKind.EXITED, node="n1")
        await driver.on_faults([Envelope(type=fault.type, source="agent", data=fault, node="n1")])

    async def both_failed() -> list[Envelope] | None:
        got = [await store.get_model(f"incidents/{r.id}", IncidentRecord) for r in (rec, quiet)]
        if not all(g is not None and g.state is IncidentState.FAILED for g in got):
            return None
        ends = await ends_heard(bus)
        return ends if {e.data.incident_id for e in ends} >= {rec.id, quiet.id} else None

    await wait_for(both_failed, timeout=5.0, what="both incidents failed and announced")
    told = [e.data for e in await bus.replay("router.>")
            if isinstance(e.data, EndpointNotRecovered) and e.data.incident_id in (rec.id, quiet.id)]
    assert [(t.model, t.engine_id, t.incident_id) for t in told] == [("m", "routed-out-e4", rec.id)]
    assert cold_engine_id(rec.id) in told[0].reason


async def test_a_failed_manual_failover_routes_its_still_serving_engine_back_in_and_thaws_its_memory(
        driver: IncidentDriver, bus: Bus, store: Store, settings: CommonSettings) -> None:
    """A failover asked for on purpose routes its healthy engine out and freezes its leases; when it fails before
    anyone took them over or stopped the engine (no standby, no room for a cold start), the engine still serves:
    at the end it is routed back in (its endpoint key put again, `router.endpoint.added` naming it as its own
    successor: routers stop holding and keep its streams) and its memory thawed (gpu_manager `thaw`), instead of
    a live engine left out of every router with its leases waiting to be reclaimed. An engine its agent stopped
    meanwhile (the view says so) is not routed back in: routers hear no successor comes, as for a failure."""
    thaws: list[Thaw] = []
    node = await Bus.connect(settings.model_copy(update={"node": "node-1"}), "gpu_manager:node-1", stream=False)

    async def thaw(cmd: Thaw) -> ThawReply:  # the node's gpu_manager, as far as this test needs one
        thaws.append(cmd)
        return ThawReply(lease_ids=["l1"])

    await node.serve("node-1", Thaw, thaw)
    recs = {}
    for eid, state in (("serving-e6", "ready"), ("stopped-e7", "stopped")):
        rec = in_fallback(eid, None).model_copy(update={
            "reason": IncidentReason.MANUAL_FAILOVER, "kind": None, "memory_lost": False,
            "endpoint": f"http://127.0.0.1:9/{eid}", "generation": 0, "node": "node-1"})
        await fail_routed_out(driver, store, rec, EngineInfo(
            engine_id=eid, node="node-1", model="m", engine_class="default", role=EngineRole.ACTIVE,
            endpoint=rec.endpoint, state=state))
        recs[eid] = rec
    try:
        async def both_ended() -> list[IncidentRecord] | None:
            ended = await failed_and_heard(store, bus, list(recs.values()))
            return ended if ended and thaws else None

        serving, stopped = await wait_for(both_ended, timeout=5.0, what="both failed, announced, one thawed")
        assert serving.serves_on and not stopped.serves_on
        told = [e.data for e in await bus.replay("router.>")
                if isinstance(e.data, (EndpointAdded, EndpointNotRecovered))
                and e.data.incident_id in (serving.id, stopped.id)]
        assert [(type(t), t.engine_id) for t in told] == [(EndpointAdded, "serving-e6"),
                                                          (EndpointNotRecovered, "stopped-e7")]
        assert told[0].url == serving.endpoint and told[0].predecessor_id == "serving-e6"
        await wait_for(lambda: store.get("endpoints/m/serving-e6"), timeout=5.0, what="its endpoint key back")
        assert await store.get("endpoints/m/stopped-e7") is None
        assert [t.incident_id for t in thaws] == [serving.id]  # a stopped engine's leases wait for their deadline
    finally:
        await node.close()


async def test_a_failed_incident_whose_early_successor_serves_routes_it_in(driver: IncidentDriver, bus: Bus,
                                                                          store: Store) -> None:
    """A shadow promoted while the freeze ran serves at once (recorded as the incident's successor). When the freeze
    then fails (the node's gpu_manager stalled or restarted: probe of 2026-12-07) and the cold start is refused (the
    successor fills the model's slot), the incident fails: the serving successor was never routed in, and the model
    had no route for good. It is routed in at the end now (its key put, `router.endpoint.added` naming it, its
    predecessor the failed engine); a successor the view has stopped is not."""
    recs = {}
    for eid, state in (("dead-e12", "ready"), ("dead-e13", "stopped")):
        sid = f"sb-{eid}"
        rec = in_fallback(eid, None).model_copy(update={"successor_id": sid, "node": "node-1",
                                                        "successor_endpoint": f"http://127.0.0.1:9/{sid}"})
        await fail_routed_out(driver, store, rec, EngineInfo(
            engine_id=sid, node="node-1", model="m", engine_class="default", role=EngineRole.ACTIVE,
            endpoint=rec.successor_endpoint, state=state))
        recs[eid] = rec

    async def both_ended() -> list[IncidentRecord] | None:
        return await failed_and_heard(store, bus, list(recs.values()))

    serving, stopped = await wait_for(both_ended, timeout=5.0, what="both failed and announced")
    assert serving.successor_serves and not serving.serves_on and not stopped.successor_serves
    told = [e.data for e in await bus.replay("router.>") if isinstance(e.data, (EndpointAdded, EndpointNotRecovered))
            and e.data.incident_id in (serving.id, stopped.id)]
    assert [(type(t), t.engine_id) for t in told] == [(EndpointAdded, "sb-dead-e12"),
                                                      (EndpointNotRecovered, "dead-e13")]
    assert told[0].url == serving.successor_endpoint and told[0].predecessor_id == "dead-e12"
    await wait_for(lambda: store.get("endpoints/m/sb-dead-e12"), timeout=5.0, what="its successor's endpoint key")
    assert await store.get("endpoints/m/sb-dead-e13") is None


async def test_a_late_ready_of_an_engine_replaced_since_routes_nothing(driver: IncidentDriver, bus: Bus,
                                                                       store: Store) -> None:
    """An engine's `engine.ready`, refused while etcd stalled and redelivered after the engine died and its incident
    resolved, wrote the dead engine's route back, and nothing removed it (a chaos run): routers sent a request there
    every few seconds, each costing it a replay. A ready of a generation an ended incident took out of service (or
    whose record says failed or stopped) routes nothing; a fresh engine's, and one that serves on, are routed."""
    gone = in_fallback("late-e8", None).model_copy(update={"state": IncidentState.RESOLVED, "successor_id": "sb-9",
                                                           "generation": 2})
    driver.view._on_incidents("put", gone.id, gone.model_dump_json().encode())  # as the watch brings it
    served_on = in_fallback("kept-e9", None).model_copy(update={"state": IncidentState.FAILED, "serves_on": True})
    driver.view._on_incidents("put", served_on.id, served_on.model_dump_json().encode())
    driver.view.engines["stopped-e10"] = EngineInfo(engine_id="stopped-e10", node="node-1", model="m",
                                                    engine_class="default", role=EngineRole.ACTIVE, state="stopped")
    for eid, generation in (("late-e8", 2), ("late-e8", 1), ("stopped-e10", 0), ("fresh-e11", 0), ("kept-e9", 0),
                            ("late-e8", 3)):
        info = EngineInfo(engine_id=eid, node="node-1", model="m", engine_class="default", role=EngineRole.ACTIVE,
                          endpoint=f"http://127.0.0.1:9/{eid}-{generation}", state="ready", generation=generation)
        ready = EngineReady(engine=info)
        await driver.on_event(Envelope(type=ready.type, source="agent", data=ready, node="node-1"))
    await driver.writer.flush()
    routes = await store.get_prefix("endpoints/m/")
    assert {k.rsplit("/", 1)[1]: v.decode() for k, v in routes.items()} == {
        "fresh-e11": "http://127.0.0.1:9/fresh-e11-0", "kept-e9": "http://127.0.0.1:9/kept-e9-0",
        "late-e8": "http://127.0.0.1:9/late-e8-3"}  # its next generation is another process: routed
    added = [e.data.engine_id for e in await bus.replay("router.>") if isinstance(e.data, EndpointAdded)]
    assert sorted(added) == ["fresh-e11", "kept-e9", "late-e8"]
