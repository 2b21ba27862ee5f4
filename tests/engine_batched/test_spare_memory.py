"""A spare's memory (engines/batched/memory.py `load_spare`, `spare_takeover`; EngineSpec.spares) with a real
gpu_manager and a real engine killed by a real signal: the spare leases its weights and a cache of its configured
size before any failure; an engine with `--kv-backup` serving 16 streams loses its GPU memory (its weights and cache
reclaimed by force, the process SIGKILLed: what a GPU fault does) once the clients saw past a backup round; its
backup is frozen alone and the spare takes it over (fenced: read once the engine has exited) and restores every
stream's vouched-for blocks into its own cache, which then holds exactly the backup's blocks. A backup of another
block count than the spare's cache gets a cache of its size. On the host backend (CPU) and, marked `gpu`, on CUDA
memory (the weights and cache in cuda-backend leases, the backup a host lease copied back by DMA)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.batched.backup import vouched
from engines.batched.backup_start import open_backup
from engines.batched.config import parse_config
from engines.batched.kv_backup import BACKUP_NAME
from engines.batched.memory import LeasedMemory, layout_fn, wait_fence
from engines.reference.config import get_config
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import Freeze, FreezeReply, ListLeases, ListLeasesReply, Reclaim, ReclaimReply, Tag
from tests.engine.conftest import tiny_weights  # noqa: F401 - fixture
from tests.engine_batched import test_failover
from tests.engine_batched.test_failover import ARGS, STREAMS, BatchedEngine, streams_started
from tests.engine_batched.test_kv_backup_failover import just_past_a_round
from tests.gpu_manager.conftest import manager_factory  # noqa: F401 - fixture

BLOCKS = 1024  # the engine's cache: 16 streams of up to 640 tokens fit (no preemption)


async def gpu_lost_under_load(first: BatchedEngine, bus: Bus, settings: CommonSettings, incident: str) -> FreezeReply:
    """What a GPU fault does to `first` once its clients saw past a backup round: its weights and cache reclaimed by
    force, the process SIGKILLed; then its KV backup frozen alone (the reply carries the transfer token)."""
    seen, threads = await asyncio.to_thread(streams_started, first, STREAMS)
    await just_past_a_round(first.url, seen)
    leases = (await bus.request(settings.node, ListLeases(owner=first.child.name), ListLeasesReply)).leases
    for lease in [i for i in leases if not i.host]:  # the GPU's memory: weights and cache
        await bus.request(settings.node, Reclaim(lease_id=lease.id, force=True), ReclaimReply)
    first.kill()
    for t in threads:
        await asyncio.to_thread(t.join, 10)
    return await bus.request(settings.node, Freeze(owner=first.child.name, incident_id=incident, backups_only=True),
                             FreezeReply)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("spare_blocks", [BLOCKS, BLOCKS // 2], ids=["same-cache", "another-cache"])
async def test_a_spare_restores_a_dead_engines_kv_backup_into_a_cache_of_its_own(
        tmp_path: Path, tiny_weights: Path, manager_factory, settings_env: dict[str, str],  # noqa: F811, ANN001
        settings: CommonSettings, bus: Bus, device: str, spare_blocks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = {"HF_BACKEND": "cuda", "HF_CHUNK_MIB": "2"} if device == "cuda" else {}
    # the streams outlast a backup round on a GPU too, and on a CPU loaded by other tests (a CI run's streams once
    # ended first at 160 tokens)
    monkeypatch.setattr(test_failover, "MAX_TOKENS", (4 if device == "cuda" else 2) * test_failover.MAX_TOKENS)
    manager = manager_factory(HF_GRACE_S="120", **backend).start()
    env = {**settings_env, "HF_GPU_MANAGER_SOCKET": manager.socket}
    first = BatchedEngine(tmp_path, tiny_weights, "bat-a", env, "--kv-backup", "--kv-backup-lag-ms", "100",
                          "--device", device, "--num-blocks", str(BLOCKS))
    await asyncio.to_thread(first.wait_ready)
    cfg = parse_config(["--weights", str(tiny_weights), "--id", "spare-1", *ARGS, "--kv-backup", "--device", device,
                        "--num-blocks", str(spare_blocks), "--role", "standby", "--spare",
                        "--gpu-manager-socket", manager.socket])
    mcfg, dev = get_config(cfg.size), torch.device(device)
    memory = LeasedMemory(cfg.id, socket_path=manager.socket, gpu=0)
    layout_of = layout_fn(cfg, mcfg, dev)
    try:
        spare = memory.load_spare(mcfg, cfg.weights, layout_of)  # before any failure
        assert spare.kv.device.type == device and spare.layout.num_blocks == spare_blocks
        held = (await bus.request(settings.node, ListLeases(owner=cfg.id), ListLeasesReply)).leases
        assert sorted(i.tag for i in held) == sorted([Tag.WEIGHTS, Tag.KV_CACHE]) and not any(i.host for i in held)
        (own_cache,) = [i.id for i in held if i.tag is Tag.KV_CACHE]

        frozen = await gpu_lost_under_load(first, bus, settings, "inc-spare")
        loaded = await asyncio.to_thread(memory.spare_takeover, mcfg, spare, "bat-a", frozen.transfer_token,
                                         layout_of, 30.0)
        wait_fence(loaded, 30.0, isolate=False)  # gone already here (a fence only while it still exits)
        assert loaded.source == "backup" and loaded.backup is not None and loaded.kv.device.type == device
        assert loaded.layout.num_blocks == BLOCKS  # the backup's block ids kept: a cache of its size
        opened = open_backup(cfg, memory, loaded)
        assert opened is not None
        writer, info = opened
        writer.stop()
        assert info["source"] == "restored" and info["restored"] == STREAMS, info
        print(f"spare on {device}, cache {spare_blocks} blocks: takeover {loaded.timings_ms}, restore {info}")  # noqa: T201
        _, entries, _, covered = vouched(loaded.backup, loaded.layout)
        assert len(entries) == STREAMS and covered
        got = loaded.kv.permute(2, 0, 1, 3, 4, 5)[covered].cpu()
        assert torch.equal(got, loaded.backup[BACKUP_NAME][covered])  # every vouched-for block, as backed up
        after = (await bus.request(settings.node, ListLeases(owner=cfg.id), ListLeasesReply)).leases
        assert [i.name for i in after if i.host] == ["kv_backup"]  # the very backup, now the spare's
        (cache,) = [i.id for i in after if i.tag is Tag.KV_CACHE]  # one cache: its own when it fits, else one anew
        assert (cache == own_cache) == (spare_blocks == BLOCKS)
        assert not (await bus.request(settings.node, ListLeases(owner="bat-a"), ListLeasesReply)).leases
    finally:
        memory.close()
        first.child.stop()


async def test_a_spare_assigned_with_no_backup_serves_afresh_on_its_own_weights_and_cache(
        tmp_path: Path, tiny_weights: Path, manager_factory, settings: CommonSettings,  # noqa: F811, ANN001
        bus: Bus) -> None:
    """The fallback of an engine that kept no backup: the spare is assigned with no predecessor and starts serving
    afresh (the routers replay the streams) on what it holds: nothing is taken over, leased or loaded."""
    manager = manager_factory(HF_GRACE_S="120").start()
    cfg = parse_config(["--weights", str(tiny_weights), "--id", "spare-2", *ARGS, "--device", "cpu",
                        "--num-blocks", "64", "--role", "standby", "--spare", "--gpu-manager-socket", manager.socket])
    mcfg = get_config(cfg.size)
    memory = LeasedMemory(cfg.id, socket_path=manager.socket, gpu=0)
    try:
        layout_of = layout_fn(cfg, mcfg, torch.device("cpu"))
        spare = memory.load_spare(mcfg, cfg.weights, layout_of)
        before = (await bus.request(settings.node, ListLeases(owner=cfg.id), ListLeasesReply)).leases
        loaded = memory.spare_takeover(mcfg, spare, "", "", layout_of, 5.0)
        assert loaded.source == "spare" and loaded.backup is None and not loaded.kv_handed_on and not loaded.fence
        assert loaded.kv.data_ptr() == spare.kv.data_ptr() and loaded.layout == spare.layout
        assert set(loaded.weights) >= set(mcfg.tensor_shapes())
        after = (await bus.request(settings.node, ListLeases(owner=cfg.id), ListLeasesReply)).leases
        assert sorted((i.id, i.epoch) for i in after) == sorted((i.id, i.epoch) for i in before)  # nothing new
    finally:
        memory.close()


# A spare in a process of its own: leases its weights and cache, says so, takes the backup named on stdin over and
# SIGKILLs itself before restoring anything (what a kill in its restore's first instant leaves: a cache handed on
# beside the backup, and no journal written in it).
SPARE_DIES = """
import os, signal, sys
import torch
from engines.batched.config import parse_config
from engines.batched.memory import LeasedMemory, layout_fn, wait_fence
from engines.reference.config import get_config
cfg = parse_config(sys.argv[1:])
mcfg = get_config(cfg.size)
memory = LeasedMemory(cfg.id, socket_path=cfg.gpu_manager_socket, gpu=0)
layout_of = layout_fn(cfg, mcfg, torch.device("cpu"))
spare = memory.load_spare(mcfg, cfg.weights, layout_of)
print("standing by", flush=True)
token = sys.stdin.readline().strip()
loaded = memory.spare_takeover(mcfg, spare, "bat-b", token, layout_of, 30.0)
wait_fence(loaded, 30.0, isolate=False)
print("taken", loaded.source, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(300)
async def test_a_spare_killed_before_it_restored_the_backup_leaves_it_to_its_successor_to_restore(
        tmp_path: Path, tiny_weights: Path, manager_factory, settings_env: dict[str, str],  # noqa: F811, ANN001
        settings: CommonSettings, bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spare SIGKILLed once it took a dead engine's KV backup over but before it restored it: its successor takes
    the spare's leases over (its weights, its cache, the backup), and since the cache holds no journal (the spare
    never wrote one) the backup is restored into it, every stream's vouched-for blocks: not kept aside as though the
    cache held the sequences (it holds none: every stream would be prefilled again)."""
    monkeypatch.setattr(test_failover, "MAX_TOKENS", 2 * test_failover.MAX_TOKENS)  # past a round on a loaded CPU
    manager = manager_factory(HF_GRACE_S="120").start()
    env = {**settings_env, "HF_GPU_MANAGER_SOCKET": manager.socket}
    first = BatchedEngine(tmp_path, tiny_weights, "bat-b", env, "--kv-backup", "--kv-backup-lag-ms", "100",
                          "--device", "cpu", "--num-blocks", str(BLOCKS))
    await asyncio.to_thread(first.wait_ready)
    args = ["--weights", str(tiny_weights), *ARGS, "--kv-backup", "--device", "cpu", "--num-blocks", str(BLOCKS),
            "--gpu-manager-socket", manager.socket]
    spare = subprocess.Popen([sys.executable, "-c", SPARE_DIES, "--id", "spare-3", "--role", "standby", "--spare",
                              *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    succ = LeasedMemory("succ-3", socket_path=manager.socket, gpu=0)
    try:
        assert spare.stdout is not None and spare.stdin is not None
        assert (await asyncio.to_thread(spare.stdout.readline)).strip() == "standing by"
        frozen = await gpu_lost_under_load(first, bus, settings, "inc-spare-3")
        spare.stdin.write(frozen.transfer_token + "\n")
        spare.stdin.flush()
        assert (await asyncio.to_thread(spare.stdout.readline)).strip() == "taken backup"
        assert await asyncio.to_thread(spare.wait, 30) == -9  # SIGKILLed, its leases orphaned with the manager
        held = (await bus.request(settings.node, ListLeases(owner="spare-3"), ListLeasesReply)).leases
        assert sorted(i.name for i in held if i.host) == ["kv_backup"] and len(held) == 3

        frozen = await bus.request(settings.node, Freeze(owner="spare-3", incident_id="inc-spare-3b"), FreezeReply)
        cfg = parse_config(["--id", "succ-3", *args])
        mcfg = get_config(cfg.size)
        layout_of = layout_fn(cfg, mcfg, torch.device("cpu"))
        loaded = await asyncio.to_thread(succ.takeover, mcfg, "spare-3", frozen.transfer_token, layout_of, 30.0)
        assert loaded.kv_handed_on and loaded.backup is not None  # the spare's cache, and the backup beside it
        opened = open_backup(cfg, succ, loaded)
        assert opened is not None
        writer, info = opened
        writer.stop()
        assert info["source"] == "restored" and info["restored"] == STREAMS, info
        _, entries, _, covered = vouched(loaded.backup, loaded.layout)
        assert len(entries) == STREAMS and covered
        got = loaded.kv.permute(2, 0, 1, 3, 4, 5)[covered]
        assert torch.equal(got, loaded.backup[BACKUP_NAME][covered])  # every vouched-for block, in the spare's cache
    finally:
        succ.close()
        if spare.poll() is None:
            spare.kill()
        first.child.stop()
