"""A gang that lost a rank's memory (its GPU marked faulty) can never be taken over: the other ranks' leases go as
soon as no process holds them, not at their deadline, and `ReclaimGang` reclaims what is left of it (host backend,
two simulated GPUs, real rank processes). Unless every rank backed its KV up to host: those backups wait for a
degraded group (gpu_manager gang.py invariant 10), which takes them all to its rank 0, with their content."""

from __future__ import annotations

import json

import pytest

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.errors import RemoteError
from libs.common.events import (
    FreezeGang,
    FreezeGangReply,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    ReclaimGang,
    ReclaimGangReply,
    SetGpuHealth,
    SetGpuHealthReply,
)
from tests.gpu_manager.harness import ManagerProc, until
from tests.gpu_manager.test_gang_restart import no_gang

RANKS = ["g", "g-r1"]  # rank r of group "g" (libs.common.events.rank_engine_id)


def gang_on_two_gpus(engines, manager: ManagerProc, backed: bool = False) -> list:  # noqa: ANN001
    """Rank r's weights and KV leases on GPU r (`backed`: and its KV backup, a host lease), registered as gang "g"."""
    group = []
    for rank, engine_id in enumerate(RANKS):
        e = engines(manager, engine_id)
        for tag in ("weights", "kv_cache"):
            assert "lease" in e.ask(f"write {1 << 20} {rank} {tag} {rank}")
        if backed:
            assert "lease" in e.ask(f"backup {1 << 16} {rank + 100} {rank} {rank} {len(RANKS)}")
        group.append(e)
    assert group[0].ask(f"call gang_register {json.dumps({'gang_id': 'g', 'owners': RANKS})}") == {"code": "ok"}
    return group


async def leases(bus: Bus, settings: CommonSettings) -> list:
    return (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases


async def lose_gpu_1(bus: Bus, settings: CommonSettings) -> list[str]:
    hit = await bus.request(settings.node, SetGpuHealth(gpu=1, healthy=False, detail="xid 79 (test)"),
                            SetGpuHealthReply)
    assert len(hit.lost_leases) == 2  # rank 1's two leases, memory lost
    return hit.lost_leases



async def test_the_rest_of_a_gang_that_lost_a_ranks_gpu_is_reclaimed_once_its_ranks_are_gone_not_at_the_deadline(
        two_gpu_manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    group = gang_on_two_gpus(engines, two_gpu_manager)
    await lose_gpu_1(bus, settings)
    left = await leases(bus, settings)
    assert [(i.owner, i.state) for i in left] == [(RANKS[0], LeaseState.ACTIVE)] * 2  # rank 0 still runs: kept
    for e in group:
        e.kill()  # the agent kills the group on the fault
    await until(lambda: _none_left(bus, settings), timeout=20)  # orphaned, then reclaimed: no 120 s wait
    await no_gang(bus, settings)


async def test_reclaim_gang_takes_what_is_left_of_a_gang_that_lost_a_rank(
        two_gpu_manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    gang_on_two_gpus(engines, two_gpu_manager)
    await lose_gpu_1(bus, settings)
    with pytest.raises(RemoteError) as refused:  # rank 0 runs: an unforced reclaim takes nothing
        await bus.request(settings.node, ReclaimGang(gang_id="g"), ReclaimGangReply)
    assert refused.value.remote_code == "invalid_transition"
    left = sorted(i.id for i in await leases(bus, settings))
    assert len(left) == 2
    reclaimed = await bus.request(settings.node, ReclaimGang(gang_id="g", force=True), ReclaimGangReply)
    assert sorted(reclaimed.lease_ids) == left
    assert await leases(bus, settings) == []
    await no_gang(bus, settings)


async def test_a_broken_gangs_backups_wait_for_a_degraded_group_whose_rank_0_takes_them_all(
        two_gpu_manager: ManagerProc, engines, bus: Bus, settings: CommonSettings) -> None:  # noqa: ANN001
    group = gang_on_two_gpus(engines, two_gpu_manager, backed=True)
    written = {f"kv_backup.tp2-r{r}": e.ask("hash")[f"kv_backup.tp2-r{r}"] for r, e in enumerate(group)}
    await lose_gpu_1(bus, settings)
    for e in group:
        e.kill()

    async def only_backups_left() -> bool:
        return sorted(i.name for i in await leases(bus, settings)) == sorted(written)
    await until(only_backups_left, timeout=20)  # rank 0's GPU memory went at once; the backups wait (grace 120 s)
    with pytest.raises(RemoteError) as whole:  # a whole-gang freeze: rank 1's weights are gone
        await bus.request(settings.node, FreezeGang(gang_id="g"), FreezeGangReply)
    assert whole.value.remote_code == "partial_gang"
    frozen = await bus.request(settings.node, FreezeGang(gang_id="g", degraded=True), FreezeGangReply)
    assert sorted(i.name for i in frozen.leases) == sorted(written)
    assert {i.state for i in frozen.leases} == {LeaseState.FROZEN}
    token = frozen.transfer_token
    alone = engines(two_gpu_manager, "d-0")
    assert alone.ask(f"gang_takeover g 0 d-0 1 {'x' * 24} degraded")["code"] == "permission_denied"  # wrong token
    got = alone.ask(f"gang_takeover g 0 d-0 1 {token} degraded")
    assert {k: got[k] for k in written} == written and got["gang"] is None  # both ranks' content; a single engine
    assert {(i.owner, i.epoch, i.state) for i in await leases(bus, settings)} == {("d-0", 2, LeaseState.ACTIVE)}
    await no_gang(bus, settings)


async def _none_left(bus: Bus, settings: CommonSettings) -> bool:
    return not await leases(bus, settings)
