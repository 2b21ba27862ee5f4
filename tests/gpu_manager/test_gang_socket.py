"""Gangs over the real engine socket and NATS commands (host backend): two rank processes' leases registered as one
gang, frozen whole; a successor group that names too few ranks, asks at a stale generation, or lacks a rank that
never asks is refused with nothing moved; one rank's leases are never taken over alone; the whole group's takeover
moves every lease in one step; a gang is reclaimed whole; a group whose asking ranks died does not block the next."""

from __future__ import annotations

import contextlib
import json
import threading
import time

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import (
    FreezeGang,
    FreezeGangReply,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    ReclaimGang,
    ReclaimGangReply,
)
from tests.gpu_manager.harness import ManagerProc

RANKS = ["g", "g-r1"]  # rank r of group "g" (libs.common.events.rank_engine_id)


def ranks_with_leases(engines, manager: ManagerProc) -> list:  # noqa: ANN001
    group = []
    for seed, engine_id in enumerate(RANKS):
        e = engines(manager, engine_id)
        assert "lease" in e.ask(f"write 4096 {seed} weights")
        assert "lease" in e.ask(f"write 4096 {seed + 10} kv_cache")
        group.append(e)
    return group


def takeover_req(successors: list[str], rank: int, token: str, generation: int = 1, wait_s: float = 10.0) -> str:
    body = {"gang_id": "g", "rank": rank, "successors": successors, "generation": generation,
            "transfer_token": token, "wait_s": wait_s}
    return f"call gang_takeover {json.dumps(body)}"


def group_asks(group: list, token: str, wait_s: float = 10.0) -> dict[int, dict]:
    """Every rank of the group `s-r0`, `s-r1` asks for its leases at once (each on its own connection): the answers."""
    answers: dict[int, dict] = {}

    def ask(rank: int, e) -> None:  # noqa: ANN001
        answers[rank] = e.ask(takeover_req(["s-r0", "s-r1"], rank, token, wait_s=wait_s))

    threads = [threading.Thread(target=ask, args=(r, e)) for r, e in enumerate(group)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return answers


async def rows(bus: Bus, settings: CommonSettings) -> list[tuple[str, str, int, str]]:
    leases = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
    return sorted((i.id, i.owner, i.epoch, i.state.value) for i in leases)


async def frozen_gang(engines, manager: ManagerProc, bus: Bus, settings: CommonSettings) -> FreezeGangReply:  # noqa: ANN001
    group = ranks_with_leases(engines, manager)
    assert group[0].ask(f"call gang_register {json.dumps({'gang_id': 'g', 'owners': RANKS})}") == {"code": "ok"}
    for e in group:
        e.kill()
    frozen = await bus.request(settings.node, FreezeGang(gang_id="g"), FreezeGangReply)
    assert frozen.owners == RANKS and frozen.generation == 1 and len(frozen.leases) == 4
    assert {i.state for i in frozen.leases} == {LeaseState.FROZEN}
    return frozen


async def test_a_partial_or_stale_successor_group_is_refused_and_nothing_moves(
        manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    frozen = await frozen_gang(engines, manager, bus, settings)
    before = await rows(bus, settings)
    s0, s1 = engines(manager, "s-r0"), engines(manager, "s-r1")
    token = frozen.transfer_token
    assert s0.ask(takeover_req(["s-r0"], 0, token))["code"] == "partial_gang"  # a group of one for two ranks
    assert s0.ask(takeover_req(["s-r0", "s-r1"], 0, token, generation=2))["code"] == "stale_gang"
    assert s0.ask(takeover_req(["s-r0", "s-r1"], 0, token, wait_s=0.5))["code"] == "partial_gang"  # rank 1 never asks
    assert s1.ask(f"takeover g-r1 {token}")["code"] == "partial_gang"  # one rank's leases alone
    assert s0.ask(takeover_req(["s-r0", "s-r1"], 0, "not-the-token-at-all"))["code"] == "permission_denied"
    assert await rows(bus, settings) == before  # nothing moved: owners, epochs, states


async def test_the_whole_group_takes_the_gang_over_in_one_step_and_a_gang_is_reclaimed_whole(
        manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    frozen = await frozen_gang(engines, manager, bus, settings)
    answers = group_asks([engines(manager, "s-r0"), engines(manager, "s-r1")], frozen.transfer_token)
    assert answers == {0: {"code": "ok"}, 1: {"code": "ok"}}
    moved = {i.id: i for i in (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases}
    successor_of = dict(zip(RANKS, ["s-r0", "s-r1"], strict=True))
    for old in frozen.leases:
        new = moved[old.id]
        assert (new.owner, new.epoch, new.state) == (successor_of[old.owner], old.epoch + 1, LeaseState.ACTIVE)
    # the gang's generation moved on: the predecessor's freeze reply is stale now
    again = await bus.request(settings.node, FreezeGang(gang_id="g"), FreezeGangReply)
    assert again.generation == 2 and again.owners == ["s-r0", "s-r1"]
    reclaimed = await bus.request(settings.node, ReclaimGang(gang_id="g"), ReclaimGangReply)
    assert sorted(reclaimed.lease_ids) == sorted(i.id for i in frozen.leases)
    assert await rows(bus, settings) == []


async def test_a_group_whose_asking_ranks_died_does_not_block_the_next_group(
        manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    """A standby group that dies mid-takeover (rank 0 asked, rank 1 never will) must not hold the gang until rank 0's
    wait runs out: the cold group that replaces it takes the gang over at once."""
    frozen = await frozen_gang(engines, manager, bus, settings)
    token = frozen.transfer_token
    dead = engines(manager, "d-r0")

    def ask_and_die() -> None:
        with contextlib.suppress(RuntimeError):  # killed while it waits: no answer ever comes
            dead.ask(takeover_req(["d-r0", "d-r1"], 0, token, wait_s=60.0))

    threading.Thread(target=ask_and_die, daemon=True).start()
    deadline = time.monotonic() + 10
    while "rank 0 of ['d-r0', 'd-r1'] asked" not in manager.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    dead.kill()
    answers = group_asks([engines(manager, "s-r0"), engines(manager, "s-r1")], token, wait_s=5.0)
    assert answers == {0: {"code": "ok"}, 1: {"code": "ok"}}
    assert {i.owner for i in (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases} == set(
        ["s-r0", "s-r1"])
