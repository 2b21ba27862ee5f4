"""A tensor-parallel group whose memory is lost (a rank's GPU failed) gets its whole gang reclaimed before its new
group is placed, so that the memory on the healthy GPU is there for it, even when the gpu_manager never heard of the
fault (its SetGpuHealth lost in a restart): the dc_manager's real intent path against a real gpu_manager and real
rank processes on two simulated GPUs (real NATS, real etcd). A successor group's gang, which keeps the gang id, is
never touched by a lost group's clean-up."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from libs.common.bus import Bus
from libs.common.cluster_view import ClusterView
from libs.common.config import CommonSettings
from libs.common.errors import RemoteError
from libs.common.events import (
    EngineSpec,
    FaultKind,
    IntentResult,
    ListLeases,
    ListLeasesReply,
    NodeInfo,
    ReclaimGang,
    ReclaimGangReply,
    RecoverIntent,
)
from libs.common.store import Store
from services.dc_manager.executor import IntentExecutor
from services.dc_manager.settings import DcManagerSettings
from tests.controller.helpers import wait_for
from tests.gpu_manager.harness import Engine, ManagerProc

MIB = 1 << 20
GPU_BYTES = 8 * MIB  # each simulated GPU: a rank's 5 MiB leave 3 MiB, too few for a new rank 0 (5 MiB)
RANKS = ["grp", "grp-r1"]  # rank r of group "grp" (libs.common.ids.rank_engine_id); its gang is "grp"


@pytest.fixture
def manager(settings_env: dict[str, str]) -> Iterator[ManagerProc]:
    env = {**settings_env, "HF_BACKEND": "host", "HF_CHUNK_MIB": "1", "HF_RECONCILE_INTERVAL_S": "0.1",
           "HF_GPUS": json.dumps(["0", "1"]), "HF_HOST_CAPACITY_BYTES": str(2 * GPU_BYTES),
           "HF_GPU_PUBLISH_INTERVAL_S": "0.1", "HF_GRACE_S": "120"}  # far beyond the test: no deadline reclaims
    mgr = ManagerProc(env, Path(settings_env["HF_STATE_DIR"])).start()
    yield mgr
    mgr.stop()


@pytest.fixture
def group(manager: ManagerProc) -> Iterator[list[Engine]]:
    """Rank r's weights (3 MiB) and KV (2 MiB) on GPU r, registered as gang "grp" once both committed."""
    ranks = [Engine(manager.socket, engine_id) for engine_id in RANKS]
    try:
        for rank, e in enumerate(ranks):
            for tag, n in (("weights", 3 * MIB), ("kv_cache", 2 * MIB)):
                assert "lease" in e.ask(f"write {n} {rank} {tag} {rank}")
        register = json.dumps({"gang_id": "grp", "owners": RANKS})
        assert ranks[0].ask(f"call gang_register {register}") == {"code": "ok"}
        yield ranks
    finally:
        for e in ranks:
            e.close()


@pytest.fixture
async def view(store: Store, settings: CommonSettings) -> AsyncIterator[ClusterView]:
    """The dc_manager's view, with the node present (what its agent writes) and a spec to cold-start from."""
    await store.put(f"nodes/{settings.node}", NodeInfo(node=settings.node, agent_pid=os.getpid(),
                                                        started_at=time.time(), gpus=[0, 1]))
    await store.put("specs/tp", EngineSpec(engine_class="tp", model="m", command=["true"], tp=2))
    v = ClusterView()
    follow = asyncio.create_task(v.follow(store))
    await asyncio.wait_for(v.synced.wait(), 10)
    yield v
    follow.cancel()


async def leases(bus: Bus, settings: CommonSettings) -> list:
    return (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases


async def test_a_lost_groups_gang_is_reclaimed_whole_before_its_cold_start_even_if_the_manager_missed_the_fault(
        group: list[Engine], view: ClusterView, bus: Bus, store: Store, settings: CommonSettings) -> None:
    await wait_for(lambda: _view_counts(view, settings, 5 * MIB), what="the gang's leases in the view")
    for e in group:
        e.kill()  # the agent kills the group on the fault; its SetGpuHealth never reached the gpu_manager
    await wait_for(lambda: _all_orphaned(bus, settings), what="the ranks' leases orphaned")

    executor = IntentExecutor(bus, store, view, DcManagerSettings(**settings.model_dump(), retries=1,
                                                                  spawn_timeout_s=1.0))
    intent = RecoverIntent(incident_id="inc-grp-g1", engine_id="grp", model="m", engine_class="tp", node=settings.node,
                           gpu=0, kind=FaultKind.GPU_FAULT, memory_lost=True, gang="grp")
    t0 = time.monotonic()
    assert await executor.on_intents([bus.envelope(intent)]) == [None]

    assert await leases(bus, settings) == []  # all four, both GPUs, at once: not at the 120 s deadline
    assert time.monotonic() - t0 < 10
    with pytest.raises(RemoteError) as gone:  # the gang ended with its last lease
        await bus.request(settings.node, ReclaimGang(gang_id="grp"), ReclaimGangReply)
    assert gone.value.remote_code == "not_found"
    result = await wait_for(lambda: _fallback(bus, "inc-grp-g1"), what="the fallback result")
    # Placed on GPU 0 with the freed room (3 MiB free there before): only the spawn failed, no agent runs here.
    assert not result.ok and "agent.spawn" in result.detail, result.detail


async def test_a_lost_groups_clean_up_never_takes_the_gang_once_another_group_holds_it(
        group: list[Engine], bus: Bus, settings: CommonSettings) -> None:
    before = sorted(i.id for i in await leases(bus, settings))
    with pytest.raises(RemoteError) as refused:
        await bus.request(settings.node, ReclaimGang(gang_id="grp", force=True, group="grp-old"), ReclaimGangReply)
    assert refused.value.remote_code == "conflict" and "grp" in refused.value.message
    assert sorted(i.id for i in await leases(bus, settings)) == before  # nothing moved
    taken = await bus.request(settings.node, ReclaimGang(gang_id="grp", force=True, group="grp"), ReclaimGangReply)
    assert sorted(taken.lease_ids) == before


async def _view_counts(view: ClusterView, settings: CommonSettings, nbytes: int) -> bool:
    return all(view.leased_bytes.get((settings.node, g), 0) == nbytes for g in (0, 1))


async def _all_orphaned(bus: Bus, settings: CommonSettings) -> bool:
    got = await leases(bus, settings)
    return len(got) == 4 and all(i.state == "ORPHANED" for i in got)


async def _fallback(bus: Bus, incident: str) -> IntentResult | None:
    got = [e.data for e in await bus.replay("intent.result")
           if isinstance(e.data, IntentResult) and e.data.incident_id == incident]
    return next((r for r in got if r.step == "fallback"), None)
