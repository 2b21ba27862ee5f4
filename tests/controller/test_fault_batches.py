"""Faults delivered together are opened together (`IncidentDriver.on_faults`), results delivered together are
routed in together (`on_results`): one incident per failed generation still, a repeated fault in the same
batch opens nothing twice, every incident resolves, and repeated results move nothing."""

from __future__ import annotations

from pathlib import Path

from libs.common.bus import Bus
from libs.common.events import EngineRole, IncidentOpened, IncidentResolved, RecoverIntent
from libs.common.ids import new_id
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState
from tests.controller.helpers import control_plane, service_env, serving_cluster, wait_for


async def test_faults_delivered_together_open_one_incident_each_and_all_resolve(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = await serving_cluster(bus, store, nodes=3, gpus_per_node=4)
    victims = [sim.engine_id(f"n{n:04d}", g) for n in range(3) for g in range(4)]
    faults = [sim.fault_event(e) for e in victims]
    # Stored before the controller starts: its durable consumer gets them all at once, in one batch, with the
    # same failure reported twice (another detector, another message id) and a standby's fault (no incident).
    faults += [faults[0], faults[5], faults[0].model_copy(update={"role": EngineRole.STANDBY, "engine_id": "standby-x"})]
    await bus.publish_all([bus.wired(f, id=new_id()) for f in faults])
    async with control_plane(bus, store, service_env(settings_env), tmp_path):
        ids = [f"inc-{e}-g0" for e in victims]

        async def all_resolved() -> list[IncidentRecord] | None:
            recs = [await store.get_model(f"incidents/{i}", IncidentRecord) for i in ids]
            # Resolved (an ended record is final: its announcement goes in a ledger), and every end heard.
            done = [r for r in recs if r is not None and r.state is IncidentState.RESOLVED]
            heard = {e.data.incident_id for e in await bus.replay("incident.>") if isinstance(e.data, IncidentResolved)}
            return done if len(done) == len(ids) and heard >= set(ids) else None

        recs = await wait_for(all_resolved, what="every incident resolved")
        assert sorted(r.engine_id for r in recs) == sorted(victims)
        assert all(r.successor_id and r.successor_id != r.engine_id for r in recs)
        events = [e.data for e in await bus.replay("incident.>")]
        assert sorted(e.incident_id for e in events if isinstance(e, IncidentOpened)) == sorted(ids)
        assert sorted(e.incident_id for e in events if isinstance(e, IncidentResolved)) == sorted(ids)
        intents = [e.data for e in await bus.replay("intent.recover") if isinstance(e.data, RecoverIntent)]
        assert sorted(i.incident_id for i in intents) == sorted(ids)
        assert sim.takeover_calls == len(ids)  # one takeover per incident: the repeated faults moved nothing
        assert await store.get("incidents/inc-standby-x-g0") is None

        # The results again, twice each, delivered together (a dc_manager's redelivery, another detector's):
        # the incidents are closed, nothing moves.
        results = [e.data for e in await bus.replay("intent.result")]
        await bus.publish_all([bus.wired(r, id=new_id()) for r in results + results])
        last = (await bus.js.stream_info(bus.settings.stream_name)).state.last_seq  # the last of them (all quiet)

        async def consumed() -> bool:
            info = await bus.js.consumer_info(bus.settings.stream_name, "controller-intents")
            return info.num_pending == 0 and info.num_ack_pending == 0 and (info.ack_floor.stream_seq or 0) >= last

        await wait_for(consumed, what="the repeated results handled")
        again = [await store.get_model(f"incidents/{i}", IncidentRecord) for i in ids]
        assert [r.model_dump_json() for r in again if r is not None] == [r.model_dump_json() for r in recs]
        added = [e.data for e in await bus.replay("router.endpoint.added")]
        assert len(added) == len(ids)
