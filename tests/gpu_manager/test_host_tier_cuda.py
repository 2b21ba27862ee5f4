"""The host tier's copy DMA'd to the device from its own page-locked pages (issue 21; host_tier_cuda.py), on a real
GPU (marked `gpu`): a restore from the tier registers the copy once, says so in its figures, and a second restore
reuses the registration; the bytes equal the snapshotted ones each time; a copy that cannot be registered leaves
nothing registered behind; the restore bench's registered and bounce paths restore the same bytes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from libs.client.memory import MemoryClient
from libs.common.events import SnapshotLease, SnapshotReply
from tests.gpu_manager.test_restore_cuda import SIZE, _weights

pytestmark = pytest.mark.gpu
MIB = 1024 * 1024


async def test_cuda_a_host_tier_restore_dmas_from_the_registered_copy_and_reuses_it(manager_factory, bus,
                                                                                    tmp_path: Path):
    m = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="128", HF_ARTIFACT_DIR=str(tmp_path / "artifacts"),
                        HF_HOST_TIER_BYTES=str(2 * SIZE)).start()
    old, lease_id, data = await asyncio.to_thread(_weights, m, "eng-reg")
    reply = await bus.request("node-1", SnapshotLease(lease_id=lease_id, artifact="r", host_tier=True), SnapshotReply,
                              timeout=120)
    assert reply.host_tier

    def restore(engine_id: str):  # noqa: ANN202
        c = MemoryClient.connect(engine_id, socket_path=m.socket)
        lease = c.restore("r", sources=["host"])
        return c, lease.torch("uint8", (SIZE,)).cpu().clone()

    first, got1 = await asyncio.to_thread(restore, "eng-r1")
    assert first.last_restore["source"] == "host" and first.last_restore["registered_dma"] == 1.0
    assert first.last_restore["register_s"] > 0 and bool((got1 == data).all())
    second, got2 = await asyncio.to_thread(restore, "eng-r2")
    assert second.last_restore["registered_dma"] == 1.0 and second.last_restore["register_s"] == 0.0  # kept
    assert bool((got2 == data).all())
    print("host tier restore, registered:", first.last_restore, second.last_restore)
    for c in (first, second, old):
        c.close()


def test_cuda_a_copy_that_cannot_be_registered_leaves_nothing_registered(tmp_path: Path):
    from libs.client import cuda_driver as cd
    from services.gpu_manager.host_tier_cuda import RegisteredCopy

    cd.init()
    fd = os.memfd_create("hf-tier-short", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4 * MIB)
    try:
        # the manifest says 64 MiB, the memfd holds 4: pinning past its end fails, and the mapping goes
        with pytest.raises(cd.CudaError):
            RegisteredCopy([fd], [64 * MIB], 0)
        ok = RegisteredCopy([fd], [4 * MIB], 0)  # the same memfd, its true size: registers (nothing was left)
        ok.close()
    finally:
        os.close(fd)


def test_cuda_the_restore_bench_registered_and_bounce_paths_restore_the_same_bytes(tmp_path: Path):
    from bench.restore import run

    out = run("cuda", 0.5, tmp_path, trials=1, workers=4, sources=("host", "host-bounce"))
    assert out["verified"] == {"host": True, "host-bounce": True} and out["host_path"] == "registered"
    assert out["host_register_s"] > 0 and out["share_of_pinned_h2d"]["host"] > 0
    print("bench restore 0.5 GiB:", out["gib_s"], out["share_of_pinned_h2d"])
