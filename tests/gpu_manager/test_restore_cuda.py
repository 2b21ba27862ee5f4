"""The cuda paths of artifacts and the host tier, on a real GPU (marked `gpu`; skipped where none is): a lease of
VMM chunks written through pinned buffers, restored into new VMM chunks on several streams with identical bytes,
a corrupt block refused; and the restore bench's sources agree on the bytes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from libs.client.memory import MemoryClient
from libs.client.protocol import ArtifactInvalid
from libs.common.events import SnapshotLease, SnapshotReply

pytestmark = pytest.mark.gpu
MIB = 1024 * 1024
SIZE = 320 * MIB  # 5 blocks of 64 MiB


def _weights(manager, engine_id: str):  # noqa: ANN001
    import torch

    c = MemoryClient.connect(engine_id, socket_path=manager.socket, engine_class="cls")
    lease = c.allocate(SIZE, tag="weights", name="w")
    t = lease.torch("uint8", (SIZE,))
    t.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device=t.device))
    c.register([lease.meta("t", "uint8", (SIZE,))])
    c.commit()
    torch.cuda.synchronize()
    return c, lease.id, t.cpu().clone()


async def test_cuda_a_snapshot_restores_into_new_vmm_chunks_with_identical_bytes(manager_factory, bus, tmp_path: Path):
    artifacts = tmp_path / "artifacts"
    m = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="128", HF_ARTIFACT_DIR=str(artifacts),
                        HF_HOST_TIER_BYTES=str(2 * SIZE)).start()
    old, lease_id, data = await asyncio.to_thread(_weights, m, "eng-gpu")
    reply = await bus.request("node-1", SnapshotLease(lease_id=lease_id, artifact="g", host_tier=True), SnapshotReply,
                              timeout=120)
    assert reply.bytes == SIZE and reply.host_tier

    def restore(sources: list[str]):  # noqa: ANN202
        c = MemoryClient.connect(f"eng-{sources[0]}", socket_path=m.socket)
        lease = c.restore("g", sources=sources)
        got = lease.torch("uint8", (SIZE,)).cpu().clone()
        return c, got

    for sources in (["artifact"], ["host"]):
        c, got = await asyncio.to_thread(restore, sources)
        assert c.last_restore["source"] == sources[0] and bool((got == data).all())
        c.close()

    with open(artifacts / "g" / "data-000.bin", "r+b") as f:
        f.seek(3 * 64 * MIB + 5)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ArtifactInvalid, match="block 3"):
        await asyncio.to_thread(restore, ["artifact"])
    old.close()


def test_cuda_restore_bench_sources_agree_on_the_bytes(tmp_path: Path):
    from bench.restore import run

    out = run("cuda", 0.5, tmp_path, trials=1, workers=4)
    assert out["verified"] == {"file": True, "artifact-buffered": True, "artifact-direct": True, "host": True,
                               "host-bounce": True}
    assert out["gib_s"]["sol_pinned_h2d"] > 0
