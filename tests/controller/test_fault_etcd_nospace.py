"""etcd out of space (its NOSPACE alarm: the backend past its quota, as at hundreds of incidents a second without
compaction): every write is refused (gRPC RESOURCE_EXHAUSTED) until an operator compacts, defragments and disarms the
alarm, which takes minutes. A fault that arrives meanwhile fails its deliveries; once space is back it must still
open its incident and resolve, not be given up as a poison message after a few seconds. Its own etcd with a small
quota (not the session's)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.errors import temporary
from libs.common.security import servers
from libs.common.security.pki import Credentials
from libs.common.security.policy import ROOT
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState, incident_id_for
from tests.conftest import TEST_IDENTITIES, _whole_keyspace
from tests.controller.helpers import control_plane, service_env, serving_cluster, wait_for

QUOTA = 8 << 20
FILL = b"x" * (1 << 20)


@pytest.fixture
def small_etcd(tmp_path: Path, credentials: Path) -> Iterator[int]:
    port, peer = procs.free_port(), procs.free_port()
    flags = [*servers.etcd_tls_flags(credentials), f"--quota-backend-bytes={QUOTA}"]
    child = procs.etcd_server(port, peer, tmp_path / "etcd", tmp_path / "etcd.log", tls_flags=flags).start()
    procs.wait_port(port, child)
    servers.etcd_setup(f"127.0.0.1:{port}", credentials, TEST_IDENTITIES, prefix="/", ranges=_whole_keyspace)
    yield port
    child.stop()


@pytest.fixture
def small_settings(settings: CommonSettings, small_etcd: int) -> CommonSettings:
    return settings.model_copy(update={"etcd_endpoints": f"127.0.0.1:{small_etcd}"})


@pytest.fixture
async def small_store(small_settings: CommonSettings) -> AsyncIterator[Store]:
    s = await Store.connect(small_settings)
    yield s
    await s.close()


async def _fill(store: Store) -> BaseException:
    """Write 1 MiB values until etcd refuses one; returns the refusal."""
    for i in range(4 * QUOTA // len(FILL)):
        try:
            await store.client.put(store.full(f"filler/{i}"), FILL)
        except Exception as e:  # noqa: BLE001 - the refusal is what this waits for
            return e
    raise AssertionError("etcd took more than its quota")


def _maintain(port: int, credentials: Path, revision: int) -> None:
    """What an operator does once the keys are deleted, as etcd's root: compact, defragment, disarm the alarm."""
    ca, key, cert = Credentials(credentials, ROOT).grpc_parts()
    channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca, key, cert))
    try:
        rpc.KVStub(channel).Compact(rpc.CompactionRequest(revision=revision, physical=True), timeout=10)
        maintenance = rpc.MaintenanceStub(channel)
        maintenance.Defragment(rpc.DefragmentRequest(), timeout=10)
        raised = maintenance.Alarm(rpc.AlarmRequest(action=rpc.AlarmRequest.GET), timeout=10).alarms
        for alarm in raised:
            maintenance.Alarm(rpc.AlarmRequest(action=rpc.AlarmRequest.DEACTIVATE, memberID=alarm.memberID,
                                               alarm=alarm.alarm), timeout=10)
    finally:
        channel.close()


async def _free(store: Store, port: int, credentials: Path) -> None:
    await store.delete_prefix("filler/")
    await asyncio.to_thread(_maintain, port, credentials, await store.revision())


async def _resolved(store: Store, inc_id: str) -> IncidentRecord | None:
    rec = await store.get_model(f"incidents/{inc_id}", IncidentRecord)
    return rec if rec is not None and rec.state is IncidentState.RESOLVED else None


async def test_a_fault_sent_while_etcd_is_out_of_space_opens_its_incident_once_space_is_back(
        bus: Bus, small_store: Store, small_settings: CommonSettings, small_etcd: int, credentials: Path,
        tmp_path: Path) -> None:
    store = small_store
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2)
    env = service_env(small_settings.to_env())
    async with control_plane(bus, store, env, tmp_path) as children:
        refusal = await _fill(store)
        assert temporary(refusal), repr(refusal)
        victim = sim.engine_id("n0000", 0)
        await sim.fail(victim)
        await asyncio.sleep(8.0)  # more than MAX_DELIVER quick redeliveries
        await _free(store, small_etcd, credentials)
        inc_id = incident_id_for(victim, sim.engines[victim].generation)
        await wait_for(lambda: _resolved(store, inc_id), timeout=40, what="the incident of the fault sent without space")
        assert children["c1"].alive() and children["dcm"].alive()
