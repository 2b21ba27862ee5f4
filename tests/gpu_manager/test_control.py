"""Control-plane commands over NATS (freeze, transfer, reclaim, list), events and the etcd mirror."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import pytest

from libs.common import procs
from libs.common.errors import RemoteError
from libs.common.events import (
    Freeze,
    FreezeReply,
    LeaseInfo,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    Reclaim,
    ReclaimReply,
    Thaw,
    ThawReply,
    Transfer,
    TransferReply,
)
from tests.gpu_manager.harness import holds_lease_memory, until

N = 2 * 1024 * 1024 + 100




async def test_freeze_then_takeover_waits_for_the_predecessor_to_die_and_bumps_the_epoch(manager, engines, bus, store):
    node = "node-1"
    old = engines(manager, "eng-old")
    wrote = old.ask(f"write {N} 11")
    standby = engines(manager, "eng-standby")

    frozen = await bus.request(node, Freeze(owner="eng-old", incident_id="inc-1"), FreezeReply)
    assert frozen.lease_ids == [wrote["lease"]] and frozen.leases[0].state == LeaseState.FROZEN
    again = await bus.request(node, Freeze(owner="eng-old"), FreezeReply)
    assert again.transfer_token == frozen.transfer_token  # idempotent

    with pytest.raises(RemoteError) as wrong:
        await bus.request(node, Transfer(owner="eng-old", successor="eng-standby", transfer_token="nope"), TransferReply)
    assert wrong.value.remote_code == "permission_denied"
    moved = await bus.request(node, Transfer(owner="eng-old", successor="eng-standby",
                                             transfer_token=frozen.transfer_token), TransferReply)
    assert moved.lease_ids == [wrote["lease"]]

    intruder = engines(manager, "eng-intruder")
    assert intruder.ask(f"takeover eng-old {frozen.transfer_token}")["code"] == "permission_denied"
    assert standby.ask(f"takeover eng-old {frozen.transfer_token}")["code"] == "predecessor_alive"
    old.kill()
    got = standby.ask(f"takeover eng-old {frozen.transfer_token}")
    assert got["leases"] == {wrote["lease"]: 2}
    assert got["data"] == wrote["expected"]

    listed = await bus.request(node, ListLeases(owner="eng-standby"), ListLeasesReply)
    assert [(i.id, i.state, i.epoch) for i in listed.leases] == [(wrote["lease"], LeaseState.ACTIVE, 2)]

    async def mirrored():
        info = await store.get_model(f"allocations/{node}/{wrote['lease']}", LeaseInfo)
        return info if info is not None and info.owner == "eng-standby" else None

    assert (await until(mirrored)).epoch == 2

    async def events():
        envs = await bus.replay(">")
        return envs if any(e.type == "memory.lease.changed" and e.data.lease.owner == "eng-standby" for e in envs) else None

    envs = await until(events)
    states = [(e.data.from_state, e.data.lease.state) for e in envs if e.type == "memory.lease.changed"]
    assert (None, LeaseState.ACTIVE) in states
    assert (LeaseState.ACTIVE, LeaseState.FROZEN) in states
    assert (LeaseState.FROZEN, LeaseState.ACTIVE) in states
    frozen_events = [e for e in envs if e.type == "memory.frozen"]
    assert frozen_events and frozen_events[0].data.lease_ids == [wrote["lease"]]
    assert frozen_events[0].incident_id == "inc-1"


async def test_a_thaw_gives_a_live_owner_its_frozen_leases_back_and_refuses_while_one_is_gone(manager, engines,
                                                                                                bus):
    """An incident begun on purpose that failed before anyone took the engine's leases over (the controller's
    `serves_on`): the leases frozen for it go back to their live owner, same epoch, token void; all or none."""
    node = "node-1"
    live = engines(manager, "eng-live")
    wrote = live.ask(f"write {N} 13")
    standby = engines(manager, "eng-next")
    frozen = await bus.request(node, Freeze(owner="eng-live", incident_id="inc-t1"), FreezeReply)
    assert (await bus.request(node, Thaw(incident_id="inc-other"), ThawReply)).lease_ids == []  # not its incident
    thawed = await bus.request(node, Thaw(incident_id="inc-t1"), ThawReply)
    assert thawed.lease_ids == [wrote["lease"]]
    listed = await bus.request(node, ListLeases(owner="eng-live"), ListLeasesReply)
    assert [(i.id, i.state, i.epoch, i.deadline, i.frozen_for) for i in listed.leases] == [
        (wrote["lease"], LeaseState.ACTIVE, 1, None, None)]
    assert (await bus.request(node, Thaw(incident_id="inc-t1"), ThawReply)).lease_ids == []  # idempotent
    assert standby.ask(f"takeover eng-live {frozen.transfer_token}")["code"] != "ok"  # the token is void
    assert live.ask("hash")["data"] == wrote["expected"]  # its memory, untouched
    live.kill()  # and a thawed lease is an owner's like any other: its death orphans it (a grace window)

    async def orphaned():
        out = await bus.request(node, ListLeases(owner="eng-live", state=LeaseState.ORPHANED), ListLeasesReply)
        return out.leases

    assert [i.id for i in await until(orphaned)] == [wrote["lease"]]

    gone = engines(manager, "eng-gone")
    kept = gone.ask(f"write {N} 14")
    await bus.request(node, Freeze(owner="eng-gone", incident_id="inc-t2"), FreezeReply)
    gone.kill()  # reaped: its process is gone
    with pytest.raises(RemoteError) as refused:
        await bus.request(node, Thaw(incident_id="inc-t2"), ThawReply)
    assert refused.value.remote_code == "conflict" and "eng-gone" in str(refused.value)
    still = await bus.request(node, ListLeases(owner="eng-gone"), ListLeasesReply)
    assert [(i.id, i.state) for i in still.leases] == [(kept["lease"], LeaseState.FROZEN)]


async def test_reclaim_command_frees_an_orphan_now_and_refuses_an_active_lease_without_force(manager, engines, bus,
                                                                                               store):
    node = "node-1"
    holder = engines(manager, "eng-held")
    held = holder.ask(f"write {N} 12")
    with pytest.raises(RemoteError) as refused:
        await bus.request(node, Reclaim(lease_id=held["lease"]), ReclaimReply)
    assert refused.value.remote_code == "invalid_transition"

    holder.kill()

    async def orphaned():
        out = await bus.request(node, ListLeases(state=LeaseState.ORPHANED), ListLeasesReply)
        return out.leases

    assert [i.id for i in await until(orphaned)] == [held["lease"]]
    done = await bus.request(node, Reclaim(lease_id=held["lease"]), ReclaimReply)
    assert done.lease.state == LeaseState.RECLAIMED
    assert not holds_lease_memory(manager.pid, held["lease"])

    async def gone():
        return await store.get(f"allocations/{node}/{held['lease']}") is None

    await until(gone)
    with pytest.raises(RemoteError) as unknown:
        await bus.request(node, Reclaim(lease_id=held["lease"]), ReclaimReply)
    assert unknown.value.remote_code == "not_found"


async def test_a_freeze_takes_the_token_its_caller_chose_unless_the_leases_are_frozen_already(manager, engines, bus):
    node = "node-1"
    old = engines(manager, "eng-chosen")
    wrote = old.ask(f"write {N} 5")
    standby = engines(manager, "eng-chosen-standby")
    chosen = "c" * 32
    frozen = await bus.request(node, Freeze(owner="eng-chosen", transfer_token=chosen), FreezeReply)
    assert frozen.transfer_token == chosen
    again = await bus.request(node, Freeze(owner="eng-chosen", transfer_token="d" * 32), FreezeReply)
    assert again.transfer_token == chosen  # frozen already: its token holds, and the reply says so
    old.kill()
    assert standby.ask(f"takeover eng-chosen {chosen}")["leases"] == {wrote["lease"]: 2}
    with pytest.raises(ValueError, match="at least 16"):
        Freeze(owner="eng-chosen-standby", transfer_token="short")  # a guessable token is not a token


async def test_the_agents_promotion_token_holds_and_a_later_freeze_of_that_incident_finds_it_handed_on(
        manager, engines, bus, store):
    """The node's agent freezes a dead engine's leases for its incident and promotes its standby itself
    (services/agent/takeover.py `promote`): its token replaces that of a freeze of the same incident that came
    first (`Freeze.promotion`), not that of another incident's; once its standby took them over, the control
    plane's freeze of that engine for that incident is answered with the handover, and for another incident it is
    not found."""
    node = "node-1"
    old = engines(manager, "eng-p")
    wrote = old.ask(f"write {N} 21")
    standby = engines(manager, "eng-p-standby")
    first = await bus.request(node, Freeze(owner="eng-p", incident_id="inc-p", transfer_token="a" * 32), FreezeReply)
    assert first.transfer_token == "a" * 32 and first.handed_to is None
    # another incident's promotion does not take the leases from this incident's freeze
    other = await bus.request(node, Freeze(owner="eng-p", incident_id="inc-q", transfer_token="q" * 32,
                                           promotion=True), FreezeReply)
    assert other.transfer_token == "a" * 32
    mine = await bus.request(node, Freeze(owner="eng-p", incident_id="inc-p", transfer_token="b" * 32,
                                          promotion=True), FreezeReply)
    assert mine.transfer_token == "b" * 32
    later = await bus.request(node, Freeze(owner="eng-p", incident_id="inc-p", transfer_token="c" * 32), FreezeReply)
    assert later.transfer_token == "b" * 32  # the control plane's, after the promotion's: the promotion's holds
    old.kill()
    assert standby.ask(f"takeover eng-p {'a' * 32}")["code"] == "permission_denied"
    assert standby.ask(f"takeover eng-p {'b' * 32}")["leases"] == {wrote["lease"]: 2}

    handed = await bus.request(node, Freeze(owner="eng-p", incident_id="inc-p", transfer_token="d" * 32), FreezeReply)
    assert handed.handed_to == "eng-p-standby" and handed.lease_ids == [wrote["lease"]]
    assert [(i.owner, i.state, i.handed_from, i.frozen_for) for i in handed.leases] == [
        ("eng-p-standby", LeaseState.ACTIVE, "eng-p", "inc-p")]
    with pytest.raises(RemoteError) as elsewhere:
        await bus.request(node, Freeze(owner="eng-p", incident_id="inc-other"), FreezeReply)
    assert elsewhere.value.remote_code == "not_found"
    listed = await bus.request(node, ListLeases(owner="eng-p-standby"), ListLeasesReply)
    assert [i.state for i in listed.leases] == [LeaseState.ACTIVE]  # the handed-on answer changed nothing


async def test_a_takeover_sent_before_the_freeze_is_held_until_it_commits(manager, engines, bus):
    """A standby promoted while its predecessor's freeze is under way (the agent's promotion, the dc_manager's early
    one) asks before the leases are frozen: the manager holds its request until the freeze commits (no poll
    interval lost), and one whose freeze never comes is told `not_frozen_yet` after a while."""
    node = "node-1"
    old = engines(manager, "eng-early")
    wrote = old.ask(f"write {N} 31")
    standby = engines(manager, "eng-early-standby")
    old.kill()
    token = "e" * 32
    asking = asyncio.ensure_future(asyncio.to_thread(standby.ask, f"takeover_fenced eng-early {token}"))
    await asyncio.sleep(0.1)
    assert not asking.done()  # held: the leases are not frozen yet
    await bus.request(node, Freeze(owner="eng-early", incident_id="inc-e", transfer_token=token), FreezeReply)
    got = await asyncio.wait_for(asking, 10)
    assert got["leases"] == {wrote["lease"]: 2}

    other = engines(manager, "eng-never")
    other.ask(f"write {N} 32")
    other.kill()
    t0 = time.monotonic()
    never = await asyncio.to_thread(standby.ask, f"takeover_fenced eng-never {token}")
    assert never["code"] == "not_frozen_yet" and time.monotonic() - t0 >= 0.2


async def test_a_freeze_whose_event_is_slow_to_store_does_not_hold_the_lease_table(manager, engines, bus):
    """`memory.frozen` is stored before the freeze's reply, but outside the lease table's lock: while the stream is
    slow to ack it (here a responder that holds the ack until the standby is served, at most HOLD_S), the standby
    held until the freeze is granted its takeover without waiting for the lock (the manager's own mark)."""
    node = "node-1"
    hold_s = 1.8  # under the bus's 2 s publish timeout
    old = engines(manager, "eng-slow")
    wrote = old.ask(f"write {N} 41")
    standby = engines(manager, "eng-slow-standby")
    old.kill()
    prefix, name = bus.link.prefix, bus.link.settings.stream_name
    config = (await bus.link.js.stream_info(name)).config
    config.subjects = [s for s in config.subjects if s != f"{prefix}.memory.>"]
    await bus.link.js.update_stream(config)  # memory events no longer stored by the stream: the responder acks them
    served = asyncio.Event()
    acked: list[bool] = []

    async def slow_ack(msg) -> None:  # noqa: ANN001 - a nats-py message
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(served.wait(), hold_s)
        acked.append(True)
        await msg.respond(json.dumps({"stream": name, "seq": 1}).encode())

    sub = await bus.link.nc.subscribe(f"{prefix}.memory.frozen.>", cb=slow_ack)
    try:
        token = "s" * 32
        asking = asyncio.ensure_future(asyncio.to_thread(standby.ask, f"takeover_fenced eng-slow {token}"))
        await asyncio.sleep(0.1)
        assert not asking.done()  # held: not frozen yet
        freezing = asyncio.ensure_future(
            bus.request(node, Freeze(owner="eng-slow", incident_id="inc-s", transfer_token=token), FreezeReply))
        got = await asyncio.wait_for(asking, 30)
        served.set()
        assert got["leases"] == {wrote["lease"]: 2}
        # held until the freeze committed, then granted: not behind the freeze's wait for the stream (old: ~HOLD_S)
        assert got["manager_ms"]["lock_wait_ms"] < hold_s * 1000 / 2, got["manager_ms"]
        frozen = await asyncio.wait_for(freezing, 30)
        assert frozen.transfer_token == token and acked  # the event was acked (stored) before the freeze answered
    finally:
        await sub.unsubscribe()


async def test_a_fenced_takeover_waits_until_the_predecessor_can_run_no_code(manager, engines, bus):
    """Fenced (protocol.TakeoverReq): refused while the predecessor runs or is merely SIGSTOPped (it may be
    continued); granted once it is killed, naming it in `fence` if it had not exited yet; the memory intact."""
    node = "node-1"
    old = engines(manager, "eng-old")
    wrote = old.ask(f"write {N} 13")
    standby = engines(manager, "eng-standby")
    frozen = await bus.request(node, Freeze(owner="eng-old", incident_id="inc-f"), FreezeReply)
    await bus.request(node, Transfer(owner="eng-old", successor="eng-standby", transfer_token=frozen.transfer_token),
                      TransferReply)
    assert standby.ask(f"takeover_fenced eng-old {frozen.transfer_token}")["code"] == "predecessor_alive"
    os.kill(old.proc.pid, signal.SIGSTOP)
    assert standby.ask(f"takeover_fenced eng-old {frozen.transfer_token}")["code"] == "predecessor_alive"
    os.kill(old.proc.pid, signal.SIGKILL)
    got = standby.ask(f"takeover_fenced eng-old {frozen.transfer_token}")
    assert got["leases"] == {wrote["lease"]: 2}
    assert got["fence"] in ([], [old.proc.pid])
    assert procs.wait_gone(old.proc.pid, None, 10.0)
    assert got["data"] == wrote["expected"]
