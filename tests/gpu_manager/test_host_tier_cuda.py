"""The host tier's copy DMA'd to the device from its own page-locked pages (issue 21; host_tier_cuda.py), on a real
GPU (marked `gpu`): the copy is registered when it is written (the snapshot's reply carries the seconds), so every
restore from it registers nothing (`register_s` 0) and DMAs; the registered bytes are the tier's (a replaced copy's
registration goes); a copy kept through a manager restart is registered again at start; with pinning off, or where
registering is refused, nothing stays registered and restores go through the bounce buffers; the bytes equal the
snapshotted ones each time; the restore bench's registered and bounce paths restore the same bytes."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from nats.errors import NoRespondersError

from libs.client.memory import MemoryClient
from libs.common.events import SnapshotLease, SnapshotReply
from tests.gpu_manager.harness import until
from tests.gpu_manager.test_restore_cuda import SIZE, _weights

pytestmark = pytest.mark.gpu
MIB = 1024 * 1024


async def _health(bus, settings) -> dict:  # noqa: ANN001
    msg = await bus.nc.request(f"{settings.subject_prefix}.health.gpu_manager", b"", timeout=10)
    return json.loads(msg.data)["detail"]


def _restore(m, engine_id: str):  # noqa: ANN001, ANN202
    c = MemoryClient.connect(engine_id, socket_path=m.socket)
    lease = c.restore("r", sources=["host"])
    return c, lease.torch("uint8", (SIZE,)).cpu().clone()


async def _tiered(manager_factory, bus, tmp_path: Path, engine_id: str, **env: str):  # noqa: ANN001, ANN202
    """A cuda manager, an engine's committed weights and their host tier copy `r`: (manager, engine, lease id,
    bytes, the snapshot's reply)."""
    m = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="128", HF_ARTIFACT_DIR=str(tmp_path / "artifacts"),
                        HF_HOST_TIER_BYTES=str(2 * SIZE), **env).start()
    engine, lease_id, data = await asyncio.to_thread(_weights, m, engine_id)
    reply = await bus.request("node-1", SnapshotLease(lease_id=lease_id, artifact="r", host_tier=True), SnapshotReply,
                              timeout=120)
    return m, engine, lease_id, data, reply


async def test_cuda_a_host_tier_copy_is_registered_at_its_write_and_no_restore_registers(manager_factory, bus, settings,
                                                                                         tmp_path: Path):
    m, old, lease_id, data, reply = await _tiered(manager_factory, bus, tmp_path, "eng-reg")
    assert reply.host_tier and reply.tier_registered and reply.tier_register_s > 0  # the write paid for it
    assert (await _health(bus, settings))["host_tier"]["registered_bytes"] == SIZE
    clients = []
    for engine_id in ("eng-r1", "eng-r2"):
        c, got = await asyncio.to_thread(_restore, m, engine_id)
        clients.append(c)
        assert c.last_restore["source"] == "host" and c.last_restore["registered_dma"] == 1.0
        assert c.last_restore["register_s"] == 0.0 and bool((got == data).all())
    again = await bus.request("node-1", SnapshotLease(lease_id=lease_id, artifact="r", host_tier=True), SnapshotReply,
                              timeout=120)
    assert again.tier_registered and again.tier_register_s > 0  # a new copy, registered anew
    tier = (await _health(bus, settings))["host_tier"]
    assert tier["registered_bytes"] == tier["bytes"] == SIZE  # the replaced copy's registration went
    c, got = await asyncio.to_thread(_restore, m, "eng-r3")
    clients.append(c)
    assert c.last_restore["registered_dma"] == 1.0 and c.last_restore["register_s"] == 0.0
    assert bool((got == data).all())
    print("host tier, registered at write:", reply, [x.last_restore for x in clients])
    for x in (*clients, old):
        x.close()


async def test_cuda_a_copy_kept_through_a_manager_restart_is_registered_again_at_start(manager_factory, bus, settings,
                                                                                       tmp_path: Path):
    m, old, lease_id, data, reply = await _tiered(manager_factory, bus, tmp_path, "eng-keep")
    assert reply.tier_registered
    old.close()
    m.kill()
    m.start()

    async def registered() -> bool:
        # The socket listens before setup ends and health is subscribed after it: "no responders" is a manager not
        # up yet. A timeout is not excused: once subscribed, health answers even while a copy registers
        # (tier_pins.py), and a stall is what this must catch.
        try:
            return (await _health(bus, settings))["host_tier"]["registered_bytes"] == SIZE
        except NoRespondersError:
            return False

    assert await until(registered, timeout=60)
    c, got = await asyncio.to_thread(_restore, m, "eng-after")
    assert c.last_restore["registered_dma"] == 1.0 and c.last_restore["register_s"] == 0.0
    assert bool((got == data).all())
    c.close()


async def test_cuda_with_pinning_off_restores_go_through_the_bounce_buffers(manager_factory, bus, settings,
                                                                            tmp_path: Path):
    m, old, lease_id, data, reply = await _tiered(manager_factory, bus, tmp_path, "eng-nopin", HF_HOST_TIER_PIN="false")
    assert reply.host_tier and not reply.tier_registered and reply.tier_register_s == 0.0
    c, got = await asyncio.to_thread(_restore, m, "eng-bounce")
    assert c.last_restore["registered_dma"] == 0.0 and c.last_restore["register_s"] == 0.0
    assert bool((got == data).all())
    assert (await _health(bus, settings))["host_tier"]["registered_bytes"] == 0
    for x in (c, old):
        x.close()


def test_cuda_a_refused_registration_pins_nothing_and_is_tried_again(tmp_path: Path):
    from libs.client import cuda_driver as cd
    from services.gpu_manager.artifact import FORMAT_VERSION, HASH, Manifest, file_names
    from services.gpu_manager.host_tier_cuda import PinnedTier

    cd.init()

    def manifest(size: int) -> Manifest:
        return Manifest(version=FORMAT_VERSION, name="short", size=size, tag="weights", lease_name="w",
                        engine_class="c", source_lease="l", layout_hash=None, tensors=[], block_bytes=4 * MIB,
                        file_bytes=64 * MIB, files=file_names(size, 64 * MIB), hash=HASH, blocks=[], root=str(size),
                        node="n", created_at=1.0, write_s=0.0)

    fd = os.memfd_create("hf-tier-short", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4 * MIB)
    pins = PinnedTier()
    try:
        # the manifest says 64 MiB, the memfd holds 4: pinning past its end is refused, and nothing stays
        assert pins.pin(manifest(64 * MIB), [fd], 0) is None
        assert pins.held() == [] and pins.bytes() == 0
        took = pins.pin(manifest(4 * MIB), [fd], 0)  # the same memfd, its true size: registered now
        assert took is not None and took > 0 and pins.held() == ["short"] and pins.bytes() == 4 * MIB
        copy, again = pins.acquire(manifest(4 * MIB), [fd], 0)  # what a restore does next: nothing to register
        assert again == 0.0
        pins.release(copy)
    finally:
        pins.close()
        os.close(fd)
    assert pins.bytes() == 0


def test_cuda_the_restore_bench_registers_at_write_and_both_host_paths_restore_the_same_bytes(tmp_path: Path):
    from bench.restore import run

    out = run("cuda", 0.5, tmp_path, trials=1, workers=4, sources=("host", "host-bounce"))
    assert out["complete"] and out["errors"] == {} and out["weights"] == "generated in a lease"  # no file
    assert out["verified"] == {"host": True, "host-bounce": True} and out["host_path"] == "registered"
    assert out["host_registered_at"] == "write" and out["host_write_s"] > out["host_register_s"] > 0
    assert out["to_ready_s"]["host"] >= out["seconds"]["host"] > 0 and out["share_of_pinned_h2d"]["host"] > 0
    assert out["host_only_room"]["device_free_gib"] > 0
    print("bench restore 0.5 GiB:", out["gib_s"], out["to_ready_s"], out["share_of_pinned_h2d"], out["host_only_room"])
