"""Weight artifacts end to end on the host backend: a real gpu_manager writes a committed lease on the
`snapshot` node command (and by policy after a first load), a new engine restores it into a new lease with the
same bytes and tensors; a truncated or corrupt artifact is refused (artifact_invalid), the half-made lease is
reclaimed, and `load_weights` falls back to the safetensors file."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest

from libs.client.memory import MemoryClient
from libs.client.protocol import ArtifactInvalid
from libs.client.safetensors_io import load_weights
from libs.common.errors import NotFound
from libs.common.events import ListLeases, ListLeasesReply, SnapshotLease, SnapshotReply
from services.gpu_manager.artifact import ALIGN, read_manifest
from tests.gpu_manager.harness import until

MIB = 1024 * 1024
SIZE = 5 * MIB  # 5 blocks of 1 MiB in 3 files of 2 MiB (the manager's settings below)
NODE = "node-1"


def load_lease(manager, engine_id: str, seed: int, engine_class: str = "default") -> tuple[MemoryClient, str, bytes]:  # noqa: ANN001
    """An engine's weights: SIZE seeded bytes as two tensors, committed."""
    client = MemoryClient.connect(engine_id, socket_path=manager.socket, engine_class=engine_class)
    lease = client.allocate(SIZE, tag="weights", name="w")
    data = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
    lease.numpy("uint8", (SIZE,))[:] = data
    client.register([lease.meta("a", "float32", (1024, 256)), lease.meta("b", "uint8", (SIZE - MIB,), offset=MIB)])
    client.commit()
    return client, lease.id, data.tobytes()


def lease_bytes(lease) -> bytes:  # noqa: ANN001
    return lease.numpy("uint8", (lease.info.size,)).tobytes()


async def test_a_snapshot_restores_into_a_new_lease_with_the_same_bytes_and_tensors(copies_manager, bus, artifacts):
    old, lease_id, data = await asyncio.to_thread(load_lease, copies_manager, "eng-old", 1)
    reply = await bus.request(NODE, SnapshotLease(lease_id=lease_id, artifact="model-a"), SnapshotReply, timeout=30)
    assert reply.artifact == "model-a" and reply.bytes == SIZE and reply.direct_io  # tmp_path is on ext4
    man = read_manifest(artifacts / "model-a")
    assert len(man.blocks) == 5 and [f.bytes for f in man.files] == [2 * MIB, 2 * MIB, MIB]
    assert all((artifacts / "model-a" / f.name).stat().st_size % ALIGN == 0 for f in man.files)
    assert man.root == reply.root_hash and {t.name for t in man.tensors} == {"a", "b"}

    new = await asyncio.to_thread(MemoryClient.connect, "eng-new", socket_path=copies_manager.socket)
    lease = await asyncio.to_thread(new.restore, "model-a")
    assert lease.id != lease_id and new.last_restore["source"] == "artifact"
    assert lease_bytes(lease) == data
    assert {m.name: (m.offset, m.shape, m.dtype) for m in lease.tensor_metas} == {
        "a": (0, [1024, 256], "float32"), "b": (MIB, [SIZE - MIB], "uint8")}
    assert all(m.lease_id == lease.id for m in lease.tensor_metas)
    digest = await asyncio.to_thread(new.commit)
    assert digest == lease.info.layout_hash
    old.close()
    new.close()


async def test_a_truncated_or_corrupt_artifact_is_refused_and_leaves_no_lease(copies_manager, bus, artifacts):
    old, lease_id, data = await asyncio.to_thread(load_lease, copies_manager, "eng-src", 2)
    await bus.request(NODE, SnapshotLease(lease_id=lease_id, artifact="m"), SnapshotReply, timeout=30)
    client = await asyncio.to_thread(MemoryClient.connect, "eng-cold", socket_path=copies_manager.socket)
    with pytest.raises(NotFound):
        await asyncio.to_thread(client.restore, "never-written")

    path = artifacts / "m" / "data-001.bin"
    with open(path, "r+b") as f:  # one flipped byte in block 3
        f.seek(MIB + 4321)
        b = f.read(1)
        f.seek(MIB + 4321)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ArtifactInvalid, match="block 3"):
        await asyncio.to_thread(client.restore, "m")

    os.truncate(path, MIB)
    with pytest.raises(ArtifactInvalid, match="truncated"):
        await asyncio.to_thread(client.restore, "m")

    (artifacts / "m" / "manifest.json").unlink()
    with pytest.raises(ArtifactInvalid, match="never finished"):
        await asyncio.to_thread(client.restore, "m")

    async def none_left() -> bool:
        listed = await bus.request(NODE, ListLeases(owner="eng-cold"), ListLeasesReply)
        return not listed.leases

    assert await until(none_left)  # the lease of the corrupt restore was reclaimed
    assert await asyncio.to_thread(client.pending) == []
    old.close()
    client.close()


async def test_load_weights_falls_back_to_the_file_and_policy_writes_an_artifact_after_a_first_load(
        copies_manager, artifacts, tmp_path):
    from safetensors.numpy import save_file

    tensors = {"x": np.arange(300_000, dtype=np.float32).reshape(600, 500), "y": np.ones((7, 9), dtype=np.float16)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))

    def first_start() -> tuple[dict, str]:
        c = MemoryClient.connect("eng-1", socket_path=copies_manager.socket, engine_class="auto-snap")
        views, source = load_weights(c, path, artifact="auto-snap.weights", framework="numpy")
        got = {k: np.array(v) for k, v in views.items()}
        c.close()
        return got, source

    got, source = await asyncio.to_thread(first_start)
    assert source == "file" and all(np.array_equal(got[k], tensors[k]) for k in tensors)
    # the policy wrote the artifact once the weights were committed (class auto-snap, lease name "weights")
    await until(lambda: (artifacts / "auto-snap.weights" / "manifest.json").exists())

    got, source = await asyncio.to_thread(first_start)
    assert source == "artifact" and all(np.array_equal(got[k], tensors[k]) for k in tensors)

    with open(artifacts / "auto-snap.weights" / "data-000.bin", "r+b") as f:
        f.write(b"\xff" * 16)
    got, source = await asyncio.to_thread(first_start)
    assert source == "file" and all(np.array_equal(got[k], tensors[k]) for k in tensors)
    man = json.loads((artifacts / "auto-snap.weights" / "manifest.json").read_text())
    assert man["engine_class"] == "auto-snap"

