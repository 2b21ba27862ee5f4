"""A fault that arrives while etcd is stalled for longer than the fault consumer's redeliveries last (SIGSTOP for
20 s: an fsync that hangs, a paused VM): each delivery fails for want of etcd, and JetStream stops redelivering a
message after `MAX_DELIVER` deliveries; once etcd is back the incident must still open and resolve. Its own etcd
(not the session's): stopping that one would stall every test."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from devstack.simcluster import SimulatedCluster
from libs.common import procs
from libs.common.bus import MAX_DELIVER, Bus
from libs.common.bus.durable import RETRY_MAX_S, retry_after
from libs.common.config import CommonSettings
from libs.common.errors import Conflict, Unavailable, temporary
from libs.common.store import Store
from services.controller.incident import IncidentRecord, IncidentState, incident_id_for
from tests.controller.helpers import control_plane, healthy, service_env, serving_cluster, start, wait_for

STALL_S = 30.0
STARTED_IN_STALL_S = 13.0  # longer than a service's start waited for etcd before (10 s)


async def _resolved(store: Store, inc_id: str) -> IncidentRecord | None:
    rec = await store.get_model(f"incidents/{inc_id}", IncidentRecord)
    return rec if rec is not None and rec.state is IncidentState.RESOLVED else None


async def _wait_resolved(store: Store, sim: SimulatedCluster, victim: str, what: str) -> None:
    """Until the incident of `victim`'s current generation (failed by the caller) is resolved."""
    inc_id = incident_id_for(victim, sim.engines[victim].generation)
    await wait_for(lambda: _resolved(store, inc_id), timeout=40, what=what)


async def test_a_fault_sent_during_a_long_etcd_stall_opens_its_incident_once_etcd_is_back(
        bus: Bus, stall_store: Store, stall_settings: CommonSettings, own_etcd: procs.Child,
        tmp_path: Path) -> None:
    store = stall_store
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2)
    env = service_env(stall_settings.to_env(), HF_LEADER_TTL_S="1")
    async with control_plane(bus, store, env, tmp_path) as children:
        victim = sim.engine_id("n0000", 0)
        os.kill(own_etcd.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.5)
            await sim.fail(victim)  # the stream takes it; the controller cannot open anything yet
            await asyncio.sleep(STALL_S)
        finally:
            os.kill(own_etcd.pid, signal.SIGCONT)
        await _wait_resolved(store, sim, victim, "the incident of the fault sent in the stall")
        assert children["c1"].alive() and children["dcm"].alive()


async def test_services_started_while_etcd_is_stalled_wait_for_it_and_then_serve(
        bus: Bus, stall_store: Store, stall_settings: CommonSettings, own_etcd: procs.Child,
        tmp_path: Path) -> None:
    # A controller (or any service) restarted while etcd is stopped: it waited 10 s for etcd, then exited 1 (a chaos
    # run's controller did, restarted by the stack's supervisor; under Kubernetes it would be held in a restart
    # backoff). It now waits as long as etcd does not answer, as its NATS connection waits for a server.
    store = stall_store
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=2)
    env = service_env(stall_settings.to_env(), HF_LEADER_TTL_S="1")
    children: dict[str, procs.Child] = {}
    os.kill(own_etcd.pid, signal.SIGSTOP)
    try:
        children["c1"] = start("services.controller", env, tmp_path / "c1.log", HF_INSTANCE="c1")
        children["dcm"] = start("services.dc_manager", env, tmp_path / "dcm.log")
        await asyncio.sleep(STARTED_IN_STALL_S)
        assert children["c1"].alive() and children["dcm"].alive(), "a service exited while etcd was stalled"
        os.kill(own_etcd.pid, signal.SIGCONT)
        await healthy(bus, "controller", "c1")
        await healthy(bus, "dc_manager", env.get("HF_DATACENTER", "dc-1"))
        victim = sim.engine_id("n0000", 1)
        await sim.fail(victim)
        await _wait_resolved(store, sim, victim, "an incident once etcd was back")
        assert children["c1"].alive() and children["dcm"].alive()
        assert "still trying" in (tmp_path / "c1.log").read_text()  # it said why it was not up
    finally:
        os.kill(own_etcd.pid, signal.SIGCONT)
        for child in children.values():
            child.stop()


def test_a_temporary_failure_is_retried_later_each_time_and_never_given_up() -> None:
    delays = [retry_after(n, is_temporary=True) for n in range(1, 200)]
    assert None not in delays
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0] and max(delays) == RETRY_MAX_S  # type: ignore[type-var]


def test_any_other_failure_gives_the_message_up_at_its_last_delivery() -> None:
    assert [retry_after(n, is_temporary=False) for n in range(1, MAX_DELIVER + 1)] == [0.5] * (MAX_DELIVER - 1) + [None]


def test_an_unreachable_etcd_or_nats_or_a_doubtful_leadership_is_temporary_and_a_conflict_is_not() -> None:
    import aetcd.exceptions
    import nats.errors

    assert temporary(aetcd.exceptions.ConnectionTimeoutError("Deadline Exceeded"))
    assert temporary(aetcd.exceptions.ConnectionFailedError("refused"))
    assert temporary(nats.errors.TimeoutError()) and temporary(Unavailable("lease not confirmed"))
    assert not temporary(Conflict("already open")) and not temporary(KeyError("bug"))


def test_an_etcd_out_of_space_is_temporary_and_a_refused_permission_is_not() -> None:
    import aetcd.exceptions
    import grpc

    def refusal(code: grpc.StatusCode, details: str) -> BaseException:
        try:
            try:
                raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
            except grpc.aio.AioRpcError as e:
                raise aetcd.exceptions.ClientError(details) from e  # as aetcd raises a status it has no class for
        except aetcd.exceptions.ClientError as e:
            return e

    assert temporary(refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded"))
    assert not temporary(refusal(grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied"))
