"""The SDK reconnects by itself after the gpu_manager is SIGKILLed and restarted: real processes, host backend."""

from __future__ import annotations

import asyncio

import pytest

from libs.client.memory import MemoryClient
from libs.common.errors import Unavailable
from libs.common.events import Freeze, FreezeReply, LeaseInfo, LeaseState, ListLeases, ListLeasesReply
from tests.gpu_manager.harness import until

N = 2 * 1024 * 1024 + 777
NODE = "node-1"



async def _lease(bus, lease_id: str) -> LeaseInfo | None:  # noqa: ANN001
    reply = await bus.request(NODE, ListLeases(), ListLeasesReply)
    return next((lease for lease in reply.leases if lease.id == lease_id), None)


async def test_a_live_engine_reconnects_by_itself_after_a_manager_restart_and_keeps_its_mapped_data(
        manager, engines, bus):  # noqa: F811 - the imported fixture
    live = engines(manager, "eng-rc")
    wrote = live.ask(f"write {N} 5")
    lease_id = wrote["lease"]
    assert live.ask("heartbeats 0.1") == {"ok": True}
    before = live.ask("status")
    assert before["connected"] and before["reconnects"] == 0

    manager.kill()
    await until(lambda: not live.ask("status")["connected"])  # the heartbeat thread saw the break
    assert live.ask("hash")["data"] == wrote["expected"]  # the engine keeps serving from its mappings
    manager.start()

    back = await until(lambda: (s := live.ask("status"))["connected"] and s)  # no explicit call from the engine
    assert back["reconnects"] == 1 and back["lost"] == {}
    assert back["leases"] == {lease_id: 1}  # same process, same epoch: nothing re-granted
    assert back["ptrs"] == before["ptrs"]  # the same mapping: the engine's tensors were never remapped
    assert back["manager_pid"] == manager.pid
    assert live.ask("hash")["data"] == wrote["expected"]
    row = await _lease(bus, lease_id)
    assert row is not None and row.state == LeaseState.ACTIVE and row.owner == "eng-rc" and row.epoch == 1

    live.kill()  # the restarted manager still tracks the engine's process
    orphaned = await until(lambda: _orphaned(bus, lease_id))
    assert orphaned.epoch == 1
    err = live.proc.stderr.read()
    assert err.count("connection to the gpu_manager lost") == 1  # one warning per outage, not per heartbeat
    assert err.count("reconnected to the gpu_manager") == 1

    successor = engines(manager, "eng-rc")
    got = successor.ask("attach")
    assert got["leases"] == {lease_id: 2}
    assert got["data"] == wrote["expected"]


async def _orphaned(bus, lease_id: str) -> LeaseInfo | None:  # noqa: ANN001
    row = await _lease(bus, lease_id)
    return row if row is not None and row.state == LeaseState.ORPHANED else None


async def test_a_lease_frozen_for_a_successor_is_reported_lost_on_reconnect_not_kept(manager, bus):
    client = MemoryClient.connect("eng-fenced", socket_path=manager.socket)
    lost: list[tuple[str, str]] = []
    client.on_lease_lost = lambda lease_id, why: lost.append((lease_id, why))
    try:
        kept = client.allocate(4096, name="kept")
        view = kept.numpy("uint8", (4096,))
        view[:] = 9
        client.register([kept.meta("kept", "uint8", (4096,))])
        client.commit()  # only a committed set is frozen for a successor (manager.py invariant 5)
        frozen = await bus.request(NODE, Freeze(owner="eng-fenced"), FreezeReply)
        assert frozen.lease_ids == [kept.id]
        manager.kill()
        manager.start()

        # the next call finds the socket broken, reconnects, resumes: the lease moved on (frozen), so it is
        # reported, not silently kept; the mapping stays readable for the engine while it stops
        pending = await asyncio.to_thread(client.pending)
        assert [info.id for info in pending] == [kept.id] and pending[0].state == LeaseState.FROZEN
        assert client.connected and client.reconnects == 1
        assert kept.id not in client.leases and kept.id in client.lost_leases
        assert lost == [(kept.id, client.lost_leases[kept.id])] and "frozen" in lost[0][1]
        assert int(view.sum()) == 9 * 4096
        row = await _lease(bus, kept.id)
        assert row is not None and row.state == LeaseState.FROZEN and row.epoch == 1
    finally:
        client.close()


async def test_a_call_while_the_manager_stays_down_fails_as_unavailable_after_its_timeout(manager):
    client = MemoryClient.connect("eng-down", socket_path=manager.socket, reconnect_timeout_s=0.5)
    try:
        manager.kill()
        with pytest.raises(Unavailable):
            await asyncio.to_thread(client.pending)
        manager.start()
        assert await asyncio.to_thread(client.pending) == []
        assert client.connected
    finally:
        client.close()


def test_an_engine_connecting_while_the_manager_restarts_waits_for_it(manager_factory) -> None:  # noqa: ANN001
    """An engine started while its gpu_manager is being restarted (socket absent, then refusing) waits for it
    (up to `reconnect_timeout_s`) instead of dying at start; past that it gets a typed `Unavailable`."""
    import threading
    import time

    manager = manager_factory()
    with pytest.raises(Unavailable, match="not listening"):
        MemoryClient.connect("eng-early", socket_path=manager.socket, reconnect_timeout_s=0.3)

    got: dict[str, object] = {}

    def connect() -> None:
        try:
            got["client"] = MemoryClient.connect("eng-early", socket_path=manager.socket, reconnect_timeout_s=60)
        except Exception as e:  # noqa: BLE001 - reported below
            got["error"] = e

    t = threading.Thread(target=connect)
    t.start()
    time.sleep(1.0)  # the engine is knocking at a socket nobody listens on
    assert t.is_alive() and not got
    manager.start()
    t.join(60)
    assert "error" not in got, got
    client = got["client"]
    assert isinstance(client, MemoryClient) and client.connected
    client.close()
