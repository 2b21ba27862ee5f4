"""A controller that lost its term between its leader check and its publish (a pause, a swap storm) still reaches
the dc_manager: its intent must not run (issue 20: nothing checked the term, and a stale leader's fallback started
a cold engine beside the successor its own successor had routed in). Real dc_manager process, NATS and etcd; the
stale leader's publish is played here, since a real controller's pause cannot be timed into that gap; the real
controller's stamp is checked end to end."""

from __future__ import annotations

import asyncio
from pathlib import Path

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import IntentResult, RecoverIntent
from libs.common.store import LeaderElection, Store
from services.controller.incident import IncidentRecord, IncidentState, incident_id_for
from tests.controller.helpers import (
    collected,
    control_plane,
    healthy,
    service_env,
    serving_cluster,
    start,
    wait_for,
)
from tests.support import ended_then_current_term


async def _results(bus: Bus, incident_id: str) -> list[IntentResult]:
    return [e.data for e in await bus.replay("intent.result")
            if isinstance(e.data, IntentResult) and e.data.incident_id == incident_id]


async def test_an_intent_of_an_ended_term_is_refused_and_the_current_terms_runs(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2)
    stale, new = await ended_then_current_term(store)
    dcm = start("services.dc_manager", service_env(settings_env, HF_ACK_WAIT_S="1"), tmp_path / "dcm.log")
    try:
        await healthy(bus, "dc_manager", "dc-1")
        assert new.term > stale
        victim, other = sim.engine_id("n0000", 0), sim.engine_id("n0000", 1)
        for fallback in (False, True):  # the stale leader's recover intent, then its fallback (a cold start)
            await bus.emit(RecoverIntent(incident_id="inc-stale", engine_id=victim, model="m", engine_class="sim",
                                         node="n0000", gpu=0, memory_lost=fallback, term=stale))
        await bus.emit(RecoverIntent(incident_id="inc-current", engine_id=other, model="m", node="n0000", gpu=1,
                                     term=new.term))
        got = await wait_for(lambda: _results(bus, "inc-current"), what="the current term's intent run")
        assert [(r.step, r.ok) for r in got] == [("reattach", True)]
        await asyncio.sleep(2.5)  # past the ack wait: a refused intent is acked, not redelivered and run later
        assert await _results(bus, "inc-stale") == []
        assert (sim.freeze_calls, sim.spawn_calls) == (1, 0), "the stale term's intents sent a command"
        log = (tmp_path / "dcm.log").read_text()
        for kind in ("recover", "fallback"):
            assert (f"intent inc-stale-{kind} of {victim} refused: stale_term: sent in controller term {stale}; "
                    f"term {new.term} leads now") in log, log[-2000:]
    finally:
        dcm.stop()
        await new.resign()


async def test_a_controllers_intents_carry_its_term_and_are_run(
        bus: Bus, store: Store, settings: CommonSettings, tmp_path: Path) -> None:
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=1)
    seen = await collected(bus, "intent.recover")
    async with control_plane(bus, store, service_env(settings.to_env()), tmp_path):
        term = await LeaderElection.current_term(store, "controller")
        victim = sim.engine_id("n0000", 0)
        await sim.fail(victim)
        inc_id = incident_id_for(victim, sim.engines[victim].generation)

        async def resolved() -> IncidentRecord | None:
            rec = await store.get_model(f"incidents/{inc_id}", IncidentRecord)
            return rec if rec is not None and rec.state is IncidentState.RESOLVED else None

        await wait_for(resolved, what="the incident resolved")
        intents = [e.data for e in seen if isinstance(e.data, RecoverIntent)]
        assert [(i.incident_id, i.term) for i in intents] == [(inc_id, term)] and term > 0


async def test_a_new_leaders_intent_is_never_dropped_as_a_duplicate_of_its_predecessors(bus: Bus) -> None:
    """The dc_manager refuses the stale leader's intent; the new leader's for the same incident must then reach it,
    not be dropped by JetStream's duplicate window as the same message: the term is in the id (within a term, one)."""
    from libs.common.cluster_view import ClusterView
    from services.controller.routes import IncidentEvents

    rec = IncidentRecord(id="inc-1", engine_id="e-1", model="m", node="n0", gpu=0)
    ids = {}
    for term in (7, 9):
        events = IncidentEvents(bus, ClusterView(), None, None, None, term=term)  # type: ignore[arg-type]
        ids[term] = [events.intent(rec, fallback=f).id for f in (False, True)]
    assert ids[7] != ids[9] and len(set(ids[7])) == 2
    assert ids[9] == [IncidentEvents(bus, ClusterView(), None, None, None, term=9)  # type: ignore[arg-type]
                      .intent(rec, fallback=f).id for f in (False, True)]  # a re-publish in one term: one message
