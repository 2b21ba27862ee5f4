"""The host tier: a copy of a class's weights kept in host memory (memfds held by the keeper) after its first
load; a cold start restores from it, also after the gpu_manager is SIGKILLed and restarted; it holds no more
than its cap."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from libs.client.memory import MemoryClient
from libs.common.errors import NotFound, RemoteError
from libs.common.events import SnapshotLease, SnapshotReply
from tests.gpu_manager.harness import until

MIB = 1024 * 1024
SIZE = 3 * MIB


def load(manager, engine_id: str, engine_class: str, seed: int):  # noqa: ANN001
    c = MemoryClient.connect(engine_id, socket_path=manager.socket, engine_class=engine_class)
    lease = c.allocate(SIZE, tag="weights", name="w")
    data = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
    lease.numpy("uint8", (SIZE,))[:] = data
    c.register([lease.meta("t", "uint8", (SIZE,))])
    c.commit()
    return c, lease.id, data.tobytes()


def restore(manager, engine_id: str, sources: list[str]) -> tuple[str, bytes]:  # noqa: ANN001
    c = MemoryClient.connect(engine_id, socket_path=manager.socket)
    try:
        lease = c.restore("tiered.w", sources=sources)
        return str(c.last_restore["source"]), lease.numpy("uint8", (SIZE,)).tobytes()
    finally:
        c.close()


async def test_a_cold_start_restores_from_the_host_tier_even_after_a_manager_restart(manager_factory, tmp_path):
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_CLASSES='["tiered"]',
                        HF_HOST_TIER_BYTES=str(4 * MIB), HF_ARTIFACT_BLOCK_BYTES=str(MIB),
                        HF_ARTIFACT_FILE_BYTES=str(2 * MIB)).start()
    first, _, data = await asyncio.to_thread(load, m, "eng-1", "tiered", 3)

    async def held() -> bool:
        try:
            return (await asyncio.to_thread(restore, m, "eng-probe", ["host"]))[1] == data
        except NotFound:
            return False

    assert await until(held)
    with pytest.raises(NotFound):  # the class is tiered, not snapshotted: no artifact on disk
        await asyncio.to_thread(restore, m, "eng-x", ["artifact"])
    first.close()

    m.kill()
    m.start()
    source, got = await asyncio.to_thread(restore, m, "eng-2", ["host", "artifact"])
    assert source == "host" and got == data


async def test_the_host_tier_refuses_a_copy_past_its_cap(manager_factory, bus, tmp_path):
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_BYTES=str(4 * MIB)).start()
    c, lease_id, _ = await asyncio.to_thread(load, m, "eng-a", "tiered", 4)
    ok = await bus.request("node-1", SnapshotLease(lease_id=lease_id, artifact="one", host_tier=True), SnapshotReply)
    assert ok.host_tier
    with pytest.raises(RemoteError) as refused:  # 3 MiB held, 3 more asked, cap 4
        await bus.request("node-1", SnapshotLease(lease_id=lease_id, artifact="two", host_tier=True), SnapshotReply)
    assert refused.value.remote_code == "out_of_memory"
    assert not (tmp_path / "a" / "two").exists()  # refused before anything was written
    again = await bus.request("node-1", SnapshotLease(lease_id=lease_id, artifact="one", host_tier=True), SnapshotReply)
    assert again.host_tier  # replacing a copy frees its own bytes first
    c.close()
