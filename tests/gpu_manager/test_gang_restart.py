"""Gangs survive a gpu_manager SIGKILL as leases do, and a gang's deadline reclaims its leases together (host
backend, real processes, real memfd memory): a registered gang is frozen, taken over by a successor group with its
bytes intact, and reclaimed whole by a manager restarted after each step; a gang whose ranks died apart (one before
the manager's SIGKILL, one while it was down) keeps every lease until its last deadline, then loses all at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import pytest

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.errors import CommandTimeout, RemoteError, Unavailable
from libs.common.events import (
    FreezeGang,
    FreezeGangReply,
    LeaseInfo,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    ReclaimGang,
    ReclaimGangReply,
)
from tests.gpu_manager.harness import ManagerProc, until
from tests.gpu_manager.test_gang_socket import RANKS, rows

SUCCESSORS = ["s-r0", "s-r1"]


def group_with_leases(engines, manager: ManagerProc) -> tuple[list, dict[str, str]]:  # noqa: ANN001
    """Two rank processes, each with a weights and a KV lease of its own bytes, registered as gang "g"; the
    sha256 each tensor should hold, by (engine, tensor)."""
    group, expected = [], {}
    for seed, engine_id in enumerate(RANKS):
        e = engines(manager, engine_id)
        for tag, n in (("weights", 3 << 20), ("kv_cache", 2 << 20)):
            wrote = e.ask(f"write {n} {seed * 10 + len(tag)} {tag}")
            expected[f"{engine_id}/{tag}"] = wrote["expected"]
        group.append(e)
    assert group[0].ask(f"call gang_register {json.dumps({'gang_id': 'g', 'owners': RANKS})}") == {"code": "ok"}
    return group, expected


def restart(manager: ManagerProc) -> None:
    keeper = manager.keeper_pid()
    manager.kill()
    manager.start()
    assert manager.keeper_pid() == keeper  # the memory came back from the same keeper


def group_takeover(engines, manager: ManagerProc, token: str, generation: int) -> dict[int, dict]:  # noqa: ANN001
    """Each rank of the successor group asks on its own connection, at once (the manager waits for both)."""
    succ = [engines(manager, engine_id) for engine_id in SUCCESSORS]
    answers: dict[int, dict] = {}

    def ask(rank: int) -> None:
        answers[rank] = succ[rank].ask(f"gang_takeover g {rank} {','.join(SUCCESSORS)} {generation} {token}")

    threads = [threading.Thread(target=ask, args=(r,)) for r in range(len(succ))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return answers


async def no_gang(bus: Bus, settings: CommonSettings) -> None:
    with pytest.raises(RemoteError, match="no gang g") as e:
        await bus.request(settings.node, FreezeGang(gang_id="g"), FreezeGangReply)
    assert e.value.remote_code == "not_found"


async def test_a_gang_survives_manager_sigkills_and_is_frozen_taken_over_and_reclaimed_whole_after_them(
        manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    group, expected = group_with_leases(engines, manager)
    for e in group:
        e.kill()
    restart(manager)

    frozen = await bus.request(settings.node, FreezeGang(gang_id="g"), FreezeGangReply)
    assert frozen.owners == RANKS and frozen.generation == 1 and len(frozen.leases) == 4
    assert {i.state for i in frozen.leases} == {LeaseState.FROZEN}
    lone = engines(manager, "s-r1")
    assert lone.ask(f"takeover g-r1 {frozen.transfer_token}")["code"] == "partial_gang"  # never one rank alone
    lone.close()
    restart(manager)  # frozen, then killed: the token and the gang both held

    answers = group_takeover(engines, manager, frozen.transfer_token, generation=1)
    for rank, (pred, succ) in enumerate(zip(RANKS, SUCCESSORS, strict=True)):
        got = answers[rank]
        assert "code" not in got, got
        assert got["gang"]["owners"] == SUCCESSORS and got["gang"]["generation"] == 2
        assert sorted(got["leases"].values()) == [2, 2]  # epoch + 1 on each of its two leases
        for tag in ("weights", "kv_cache"):
            assert got[tag] == expected[f"{pred}/{tag}"], (succ, tag)  # the bytes the predecessor rank wrote
    before = await rows(bus, settings)
    restart(manager)  # the takeover's owners, epochs and generation were written with it
    assert await rows(bus, settings) == before

    again = await bus.request(settings.node, FreezeGang(gang_id="g"), FreezeGangReply)
    assert again.owners == SUCCESSORS and again.generation == 2
    assert sorted(i.id for i in again.leases) == sorted(i.id for i in frozen.leases)
    reclaimed = await bus.request(settings.node, ReclaimGang(gang_id="g", force=True), ReclaimGangReply)
    assert sorted(reclaimed.lease_ids) == sorted(i.id for i in frozen.leases)
    restart(manager)
    assert await rows(bus, settings) == []
    await no_gang(bus, settings)  # the gang ended with its leases, durably


GRACE_S = 6.0


async def leases_of(bus: Bus, settings: CommonSettings, ids: set[str]) -> list[LeaseInfo]:
    # a generous limit: on a loaded 2-core machine (parallel test workers) a listing can take seconds
    reply = await bus.request(settings.node, ListLeases(), ListLeasesReply, timeout=15)
    return [i for i in reply.leases if i.id in ids]


async def orphaned_deadline(bus: Bus, settings: CommonSettings, ids: set[str], owner: str) -> float:
    """Once the owner's leases are ORPHANED: their deadline (wall clock)."""
    async def orphaned() -> float | None:
        mine = [i for i in await leases_of(bus, settings, ids) if i.owner == owner]
        if mine and all(i.state == LeaseState.ORPHANED and i.deadline is not None for i in mine):
            return max(i.deadline for i in mine)  # type: ignore[type-var]
        return None

    return await until(orphaned)


async def test_a_gangs_leases_are_reclaimed_together_at_its_last_deadline_across_a_manager_restart(
        manager_factory, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    manager = manager_factory(HF_GRACE_S=str(GRACE_S)).start()
    group, _ = group_with_leases(engines, manager)
    ids = {i for i, *_ in await rows(bus, settings)}
    assert len(ids) == 4
    seen: list[tuple[float, int]] = []  # (wall clock, the gang's leases listed) of every look, from now on

    async def look() -> None:
        while not seen or seen[-1][1]:
            with contextlib.suppress(RemoteError, Unavailable, CommandTimeout, TimeoutError):  # manager restarting
                seen.append((time.time(), len(await leases_of(bus, settings, ids))))
            await asyncio.sleep(0.05)

    looking = asyncio.create_task(look())
    group[1].kill()  # rank 1 dies first: its leases orphaned, their deadline GRACE_S from now
    d1 = await orphaned_deadline(bus, settings, ids, RANKS[1])
    restart(manager)
    await asyncio.sleep(max(0.0, d1 - GRACE_S + 2.0 - time.time()))  # rank 0 dies >= 2 s after rank 1
    group[0].kill()  # in a manager restarted since rank 1's death
    d0 = await orphaned_deadline(bus, settings, ids, RANKS[0])
    assert d0 > d1 + 1.5  # the ranks' own deadlines apart
    await asyncio.wait_for(looking, timeout=d0 - time.time() + 30)
    # every look saw the whole gang or none of it: never a rank's lease reclaimed while another's waited
    assert {n for _, n in seen} == {4, 0}, seen
    assert any(d1 + 0.5 < t and n == 4 for t, n in seen)  # rank 1's own deadline passed, its leases kept
    assert min(t for t, n in seen if n == 0) >= d0  # all gone at the gang's last deadline, not before
    await no_gang(bus, settings)  # the gang ended with its last leases
