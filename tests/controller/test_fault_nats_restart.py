"""The control plane's nats-server SIGKILLed and started again on the same port: on its store dir, while idle and
while an incident is in flight (the controller and the dc_manager reconnect, their durable consumers carry on, and
every incident resolves exactly once); and on an empty one (a lost volume: the stream and every durable consumer
gone), after which the services make them again and the next fault is still recovered. Its own nats-server (not the
session's): killing that one would break every test."""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState, incident_id_for
from tests.controller.helpers import collected, control_plane, service_env, serving_cluster, wait_for


class OwnNats:
    """A nats-server of this test's own, killed and started again on its port and store dir."""

    def __init__(self, tmp_path: Path, conf: Path) -> None:
        self.port = procs.free_port()
        self.dir, self.log, self.conf = tmp_path / "nats", tmp_path / "nats.log", conf
        self.child = self._start()

    def _start(self) -> procs.Child:
        child = procs.nats_server(self.port, self.dir, self.log, config=self.conf).start()
        procs.wait_port(self.port, child)
        return child

    def restart(self, *, wipe: bool = False) -> None:
        self.child.kill(signal.SIGKILL)
        assert self.child.proc is not None
        self.child.proc.wait()
        if wipe:
            shutil.rmtree(self.dir)
        self.child = self._start()


@pytest.fixture
def own_nats(tmp_path: Path, nats_conf: Path) -> Iterator[OwnNats]:
    n = OwnNats(tmp_path, nats_conf)
    yield n
    n.child.stop()


@pytest.fixture
def nats_settings(settings: CommonSettings, own_nats: OwnNats) -> CommonSettings:
    return settings.model_copy(update={"nats_url": f"nats://127.0.0.1:{own_nats.port}"})


@pytest.fixture
async def own_bus(nats_settings: CommonSettings) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_settings, "test")
    yield b
    await b.close()


async def _ended(store: Store, inc_id: str) -> IncidentRecord | None:
    rec = await store.get_model(f"incidents/{inc_id}", IncidentRecord)
    return rec if rec is not None and rec.state in (IncidentState.RESOLVED, IncidentState.FAILED) else None


async def _connected(bus: Bus) -> bool:
    return bus.link.nc.is_connected  # type: ignore[attr-defined]


async def test_incidents_resolve_once_across_nats_server_restarts(
        own_bus: Bus, store: Store, nats_settings: CommonSettings, own_nats: OwnNats, tmp_path: Path) -> None:
    bus = own_bus
    gate = asyncio.Event()
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=4, takeover_gate=gate)
    ends = await collected(bus, "incident.resolved", "incident.failed")
    env = service_env(nats_settings.to_env())
    async with control_plane(bus, store, env, tmp_path) as children:
        gate.set()
        first = sim.engine_id("n0000", 0)
        await sim.fail(first)
        first_id = incident_id_for(first, sim.engines[first].generation)
        assert (await wait_for(lambda: _ended(store, first_id), what="the first incident ended")).state \
            is IncidentState.RESOLVED

        own_nats.restart()  # idle
        await wait_for(lambda: _connected(bus), what="the test's bus reconnected")
        await asyncio.sleep(2.0)
        second = sim.engine_id("n0000", 1)
        await sim.fail(second)
        second_id = incident_id_for(second, sim.engines[second].generation)
        rec = await wait_for(lambda: _ended(store, second_id), timeout=30, what="an incident after an idle restart")
        assert rec.state is IncidentState.RESOLVED, rec

        sim.takeover_started.clear()
        gate.clear()  # in flight: the takeover held while nats-server dies
        third = sim.engine_id("n0000", 2)
        await sim.fail(third)
        third_id = incident_id_for(third, sim.engines[third].generation)
        await wait_for(lambda: asyncio.sleep(0, sim.takeover_started.is_set()), what="the takeover started")
        own_nats.restart()
        gate.set()
        rec = await wait_for(lambda: _ended(store, third_id), timeout=40, what="the in-flight incident ended")
        assert rec.state is IncidentState.RESOLVED, rec

        fourth = sim.engine_id("n0000", 3)
        await sim.fail(fourth)
        fourth_id = incident_id_for(fourth, sim.engines[fourth].generation)
        rec = await wait_for(lambda: _ended(store, fourth_id), timeout=30, what="an incident after both restarts")
        assert rec.state is IncidentState.RESOLVED, rec
        await asyncio.sleep(1.0)
        counts: dict[tuple[str | None, str], int] = {}
        for e in ends:
            iid = (e.incident_id, e.type)
            counts[iid] = counts.get(iid, 0) + 1
        assert counts == {(i, "incident.resolved"): 1 for i in (first_id, second_id, third_id, fourth_id)}, counts
        assert all(c.alive() for c in children.values())


async def test_the_stream_and_consumers_are_made_again_after_nats_server_lost_its_store(
        own_bus: Bus, store: Store, nats_settings: CommonSettings, own_nats: OwnNats, tmp_path: Path) -> None:
    bus = own_bus
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2)
    env = service_env(nats_settings.to_env())
    async with control_plane(bus, store, env, tmp_path) as children:
        first = sim.engine_id("n0000", 0)
        await sim.fail(first)
        first_id = incident_id_for(first, sim.engines[first].generation)
        await wait_for(lambda: _ended(store, first_id), what="the first incident ended")

        own_nats.restart(wipe=True)  # no stream, no consumer: as a server on a new, empty volume
        await wait_for(lambda: _connected(bus), what="the test's bus reconnected")

        async def stream_back() -> bool:
            try:
                await bus.js.stream_info(nats_settings.stream_name)
                return True
            except Exception:  # noqa: BLE001 - not made again yet
                return False

        await wait_for(stream_back, timeout=20, what="a service making the stream again")
        second = sim.engine_id("n0000", 1)
        await sim.fail(second)
        second_id = incident_id_for(second, sim.engines[second].generation)
        rec = await wait_for(lambda: _ended(store, second_id), timeout=30, what="an incident after the store was lost")
        assert rec.state is IncidentState.RESOLVED, rec
        assert all(c.alive() for c in children.values())
