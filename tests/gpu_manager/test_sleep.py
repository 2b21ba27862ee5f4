"""KV sleep/wake on the host backend (issue 21): a sleeping lease's memory leaves the manager, the keeper and the
engine (its memfds closed everywhere) while the engine keeps its addresses; a wake maps fresh memory there; a
weights lease comes back from its copy; the control plane's ask reaches the engine through its heartbeat; a
sleeping engine's death leaves nothing to hand on."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from libs.client.memory import MemoryClient
from libs.client.protocol import Ask
from libs.common.errors import Conflict, RemoteError
from libs.common.events import (
    Freeze,
    FreezeReply,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    SleepEngine,
    SleepEngineReply,
)
from tests.gpu_manager.harness import holds_lease_memory, until

MIB = 1024 * 1024


def engine(manager, engine_id: str, *, weights: bool = False, shift: int = 0):  # noqa: ANN001
    """A client with a committed KV lease (and a weights lease), each filled with a known pattern (the weights'
    shifted by `shift`: another model's bytes of the same class and shape)."""
    c = MemoryClient.connect(engine_id, socket_path=manager.socket, engine_class="sleepy")
    kv = c.allocate(3 * MIB, tag="kv_cache", name="kv")
    kv.numpy("uint8", (3 * MIB,))[:] = 9
    metas = [kv.meta("kv", "uint8", (3 * MIB,))]
    w = None
    if weights:
        w = c.allocate(2 * MIB, tag="weights", name="w")
        w.numpy("uint8", (2 * MIB,))[:] = (np.arange(2 * MIB, dtype=np.uint64) + shift).astype(np.uint8)
        metas.append(w.meta("w", "uint8", (2 * MIB,)))
    c.register(metas)
    c.commit()
    return c, kv, w


async def states(bus, owner: str) -> dict[str, LeaseState]:  # noqa: ANN001
    reply = await bus.request("node-1", ListLeases(owner=owner), ListLeasesReply)
    return {lease.id: lease.state for lease in reply.leases}


async def test_a_kv_lease_sleeps_without_memory_anywhere_and_wakes_fresh_at_the_same_address(manager, bus):
    c, kv, _ = await asyncio.to_thread(engine, manager, "eng-s1")
    ptr, keeper = kv.ptr, manager.keeper_pid()
    assert holds_lease_memory(manager.pid, kv.id) and holds_lease_memory(os.getpid(), kv.id) is False  # mapped only

    slept = await asyncio.to_thread(c.sleep, [kv.id])
    assert slept.bytes == 3 * MIB and slept.lease_ids == [kv.id]
    assert (await states(bus, "eng-s1"))[kv.id] == LeaseState.SLEEPING
    assert not holds_lease_memory(manager.pid, kv.id) and not holds_lease_memory(keeper, kv.id)
    with open(f"/proc/{os.getpid()}/maps") as f:  # the range is still reserved here, and maps no memfd of it
        maps = f.read()
    assert f"hf-{kv.id}-" not in maps and f"{ptr:x}-" in maps

    await asyncio.to_thread(c.wake, [kv.id])
    assert kv.ptr == ptr and (await states(bus, "eng-s1"))[kv.id] == LeaseState.ACTIVE
    view = kv.numpy("uint8", (3 * MIB,))
    assert not view.any()  # new memory: the cache's content is gone
    view[:] = 5  # and it is writable, at the same addresses
    assert holds_lease_memory(manager.pid, kv.id) and holds_lease_memory(keeper, kv.id)
    c.close()


async def test_a_sleeping_lease_is_not_counted_and_a_wake_past_capacity_is_refused(manager_factory, bus):
    m = manager_factory(HF_HOST_CAPACITY_BYTES=str(4 * MIB)).start()
    c, kv, _ = await asyncio.to_thread(engine, m, "eng-s2")
    await asyncio.to_thread(c.sleep, [kv.id])
    other = await asyncio.to_thread(MemoryClient.connect, "eng-other", socket_path=m.socket)
    taken = await asyncio.to_thread(other.allocate, 3 * MIB, tag="weights")  # room only because kv sleeps
    from libs.client.protocol import OutOfMemory

    with pytest.raises(OutOfMemory):
        await asyncio.to_thread(c.wake, [kv.id])
    assert (await states(bus, "eng-s2"))[kv.id] == LeaseState.SLEEPING  # refused: nothing changed
    await asyncio.to_thread(other.release, taken.id)
    await asyncio.to_thread(c.wake, [kv.id])
    other.close()
    c.close()


async def test_level_2_releases_the_weights_and_the_wake_restores_them_from_the_host_tier(manager_factory, bus,
                                                                                         tmp_path):
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_BYTES=str(8 * MIB),
                        HF_ARTIFACT_BLOCK_BYTES=str(MIB), HF_ARTIFACT_FILE_BYTES=str(2 * MIB)).start()
    c, kv, w = await asyncio.to_thread(engine, m, "eng-s3", weights=True)
    before = w.numpy("uint8", (2 * MIB,)).copy()
    ptr = w.ptr
    await asyncio.to_thread(c.sleep, [kv.id, w.id])
    assert not holds_lease_memory(m.pid, w.id) and not holds_lease_memory(m.keeper_pid(), w.id)
    assert not (tmp_path / "a" / "sleepy.w").exists()  # the host tier had room: no disk write
    source = await asyncio.to_thread(c.wake, [kv.id, w.id])
    assert source == "host" and w.ptr == ptr
    assert np.array_equal(w.numpy("uint8", (2 * MIB,)), before)
    c.close()


async def test_level_2_without_host_tier_room_sleeps_to_the_artifact(manager_factory, tmp_path):
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_BYTES="0",
                        HF_ARTIFACT_BLOCK_BYTES=str(MIB), HF_ARTIFACT_FILE_BYTES=str(2 * MIB)).start()
    c, _, w = await asyncio.to_thread(engine, m, "eng-s4", weights=True)
    before = w.numpy("uint8", (2 * MIB,)).copy()
    await asyncio.to_thread(c.sleep, [w.id])
    assert (tmp_path / "a" / "sleepy.w" / "manifest.json").exists()
    assert await asyncio.to_thread(c.wake, [w.id]) == "artifact"
    assert np.array_equal(w.numpy("uint8", (2 * MIB,)), before)
    c.close()


@pytest.mark.parametrize("tier", [8 * MIB, 0], ids=["host-tier", "artifact"])
async def test_a_sleeping_engine_of_a_class_wakes_after_another_of_its_class_slept_and_is_never_stranded(
        manager_factory, bus, tmp_path, tier):
    """The second engine's sleep wrote its copy under the class's one name over the first's, whose wake then found
    none for good (its memory gone): `not_found`, a restart the only way back. The same bytes now serve either wake;
    other bytes never replace a copy a sleeper wakes from (that sleep is refused, its engine keeps its memory)."""
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_BYTES=str(tier),
                        HF_ARTIFACT_BLOCK_BYTES=str(MIB), HF_ARTIFACT_FILE_BYTES=str(2 * MIB)).start()
    a, _, wa = await asyncio.to_thread(engine, m, "eng-a", weights=True)
    b, _, wb = await asyncio.to_thread(engine, m, "eng-b", weights=True)
    other, _, wo = await asyncio.to_thread(engine, m, "eng-other", weights=True, shift=7)
    before = wa.numpy("uint8", (2 * MIB,)).copy()
    await asyncio.to_thread(a.sleep, [wa.id])
    await asyncio.to_thread(b.sleep, [wb.id])  # the same bytes: its copy is the first's root
    with pytest.raises(Conflict, match=f"what sleeping lease.*{wa.id}.*wake from"):
        await asyncio.to_thread(other.sleep, [wo.id])
    assert (await states(bus, "eng-other"))[wo.id] == LeaseState.ACTIVE
    assert np.array_equal(wo.numpy("uint8", (2 * MIB,)), (before.astype(np.uint16) + 7).astype(np.uint8))
    for c, w in ((a, wa), (b, wb)):
        assert await asyncio.to_thread(c.wake, [w.id]) == ("host" if tier else "artifact")
        assert np.array_equal(w.numpy("uint8", (2 * MIB,)), before)
    await asyncio.to_thread(other.sleep, [wo.id])  # no sleeper left on that copy: replaced, and woken from
    await asyncio.to_thread(other.wake, [wo.id])
    assert np.array_equal(wo.numpy("uint8", (2 * MIB,)), (before.astype(np.uint16) + 7).astype(np.uint8))
    for c in (a, b, other):
        c.close()


async def test_the_control_planes_ask_reaches_the_engine_through_its_heartbeat(manager, bus):
    c, kv, _ = await asyncio.to_thread(engine, manager, "eng-s5")
    seen: list[Ask] = []

    def on_ask(ask: Ask) -> None:  # as an engine would: on a thread of its own, then answer
        def act() -> None:
            seen.append(ask)
            if ask.op == "sleep":
                c.sleep([kv.id], ask=ask.id)
            else:
                c.wake([kv.id], ask=ask.id)
            c.answer(ask.id)

        threading.Thread(target=act).start()

    c.on_ask = on_ask
    c.start_heartbeats(0.05)
    slept = await bus.request("node-1", SleepEngine(engine_id="eng-s5", timeout_s=10), SleepEngineReply, timeout=15)
    assert slept.state == "sleeping" and slept.bytes == 3 * MIB and slept.lease_ids == [kv.id]
    with pytest.raises(RemoteError) as again:  # wrong state: typed
        await bus.request("node-1", SleepEngine(engine_id="eng-s5"), SleepEngineReply)
    assert again.value.remote_code == Conflict.code
    with pytest.raises(RemoteError) as unknown:
        await bus.request("node-1", SleepEngine(engine_id="eng-nobody"), SleepEngineReply)
    assert unknown.value.remote_code == "not_found"
    woke = await bus.request("node-1", SleepEngine(engine_id="eng-s5", wake=True, timeout_s=10), SleepEngineReply,
                             timeout=15)
    assert woke.state == "awake" and woke.bytes == 3 * MIB
    assert [a.op for a in seen] == ["sleep", "wake"]
    c.close()


async def test_an_engine_that_refuses_the_ask_fails_the_command_with_its_reason(manager, bus):
    c, _, _ = await asyncio.to_thread(engine, manager, "eng-s6")
    c.on_ask = lambda ask: c.answer(ask.id, Conflict("3 sequences in flight"))
    c.start_heartbeats(0.05)
    with pytest.raises(RemoteError) as refused:
        await bus.request("node-1", SleepEngine(engine_id="eng-s6", timeout_s=10), SleepEngineReply, timeout=15)
    assert refused.value.remote_code == "conflict" and "in flight" in refused.value.message
    c.close()


async def test_a_sleeping_engines_death_hands_on_its_weights_and_reclaims_its_empty_kv(manager, bus, engines):
    eng = engines(manager, "eng-s7")
    weights = eng.ask("write 2097152 1 weights")["lease"]
    kv = eng.ask("write 1048576 2 kv_cache")["lease"]
    assert eng.ask(f"sleep {kv}")["ok"]
    eng.kill()
    assert await until(lambda: _state_is(bus, "eng-s7", kv, None))  # reclaimed: no memory to hand on
    frozen = await bus.request("node-1", Freeze(owner="eng-s7"), FreezeReply)
    assert frozen.lease_ids == [weights]  # the successor gets the weights and leases a new cache


async def test_a_freeze_of_a_live_sleeping_engine_reclaims_its_sleeping_leases(manager, bus, engines):
    eng = engines(manager, "eng-s8")
    weights = eng.ask("write 2097152 1 weights")["lease"]
    kv = eng.ask("write 1048576 2 kv_cache")["lease"]
    assert eng.ask(f"sleep {kv}")["ok"]
    frozen = await bus.request("node-1", Freeze(owner="eng-s8"), FreezeReply)
    assert frozen.lease_ids == [weights]
    assert kv not in await states(bus, "eng-s8")


async def _state_is(bus, owner: str, lease_id: str, want: LeaseState | None) -> bool:  # noqa: ANN001
    return (await states(bus, owner)).get(lease_id) == want
