"""Weights from a peer (issue 22, item 5): a restore served by copying another engine's live weights lease of the same
content on another GPU of the node, and the peers that must not serve: content that differs from the node's copy,
bytes written after their digest, a peer released or its GPU marked unhealthy while it is held. Each falls back to
the host tier with the right bytes. A real gpu_manager (host backend, two simulated GPUs) and real clients."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from libs.client.memory import MemoryClient
from libs.common.errors import NotFound
from libs.common.events import SetGpuHealth, SetGpuHealthReply, SnapshotLease, SnapshotReply
from tests.gpu_manager.harness import until

MIB = 1024 * 1024
SIZE = 3 * MIB
CLASS = "m"
COPY = "m.w"
SMALL_BLOCKS = {"HF_ARTIFACT_BLOCK_BYTES": str(MIB), "HF_ARTIFACT_FILE_BYTES": str(2 * MIB), "HF_GPUS": '["0","1"]',
                "HF_GRACE_S": "120"}


def pattern(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


def load(manager, engine_id: str, seed: int, gpu: int):  # noqa: ANN001
    """An engine's weights lease on `gpu`, filled, registered and committed: (client, lease, bytes)."""
    c = MemoryClient.connect(engine_id, socket_path=manager.socket, engine_class=CLASS)
    lease = c.allocate(SIZE, tag="weights", name="w", gpu=gpu)
    data = pattern(seed)
    lease.numpy("uint8", (SIZE,))[:] = data
    c.register([lease.meta("t", "uint8", (SIZE,))])
    c.commit()
    return c, lease, data.tobytes()


def restore(manager, engine_id: str, gpu: int, sources: tuple[str, ...] = ("peer", "host", "artifact")):  # noqa: ANN001
    """A cold start's restore on `gpu`: (source, bytes, last_restore)."""
    c = MemoryClient.connect(engine_id, socket_path=manager.socket, engine_class=CLASS)
    try:
        lease = c.restore(COPY, gpu=gpu, sources=sources)
        return str(c.last_restore["source"]), lease.numpy("uint8", (SIZE,)).tobytes(), dict(c.last_restore)
    finally:
        c.close()


async def published(store, kind: str) -> dict[str, Any]:  # noqa: ANN001
    """Wait for the node's GPU records to list the copy as `kind` (the digest pass or the tier copy done)."""
    async def record() -> dict[str, Any] | None:
        raw = await store.get("gpus/node-1/0")
        rec = json.loads(raw) if raw else None
        return rec if rec and rec.get("copies", {}).get(COPY) == kind else None

    return await until(record)


async def test_a_restore_is_served_by_a_peer_lease_on_the_other_gpu_with_its_bytes(manager_factory, store, tmp_path):
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_PEER_CLASSES=f'["{CLASS}"]', **SMALL_BLOCKS).start()
    a, lease, data = await asyncio.to_thread(load, m, "eng-a", 3, 0)
    await published(store, "peer")  # hashed after its commit: a peer now, and placement hears of it
    # No host tier, no artifact: before the peer source this restore was `not_found` (the engine read its file).
    source, got, last = await asyncio.to_thread(restore, m, "eng-b", 1)
    assert source == "peer" and got == data
    assert last["peer"] == {"lease": lease.id, "gpu": 0, "owner": "eng-a"}
    assert last["bytes"] == SIZE and last["peer_gpu"] == 0 and last["fill_s"] >= 0
    assert np.array_equal(lease.numpy("uint8", (SIZE,)), pattern(3))  # the peer itself untouched
    a.close()


async def test_a_peer_whose_content_differs_from_the_node_copy_is_passed(manager_factory, bus, store, tmp_path):
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_BYTES=str(8 * MIB),
                        HF_PEER_CLASSES=f'["{CLASS}"]', **SMALL_BLOCKS).start()
    a, lease_a, data = await asyncio.to_thread(load, m, "eng-a", 3, 0)
    await bus.request("node-1", SnapshotLease(lease_id=lease_a.id, host_tier=True), SnapshotReply)
    await asyncio.to_thread(a.release, lease_a.id)  # the node keeps seed 3 in its host tier; its lease is gone
    other, lease_c, _ = await asyncio.to_thread(load, m, "eng-c", 4, 1)  # same class and name, another content
    await until(lambda: any(lease_c.id in p and "is not the node copy's" in p for p in passed_peers(m)))
    source, got, last = await asyncio.to_thread(restore, m, "eng-b", 0)
    assert source == "host" and got == data
    assert any(lease_c.id in p and "is not the node copy's" in p for p in last["passed"]), last
    a.close()
    other.close()


def passed_peers(manager) -> list[str]:  # noqa: ANN001
    """Why each peer was passed, as a peer-only restore says (no lease made: none serves)."""
    try:
        restore(manager, "eng-probe", 0, ("peer",))
    except NotFound as e:
        return [p for p in e.message.split(": ", 1)[-1].split("; ") if p.startswith("peer ")]
    return []


async def test_a_peer_written_after_its_digest_is_caught_by_the_block_hashes(manager_factory, bus, store, tmp_path):
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_BYTES=str(8 * MIB), **SMALL_BLOCKS).start()
    a, lease, data = await asyncio.to_thread(load, m, "eng-a", 3, 0)
    await bus.request("node-1", SnapshotLease(lease_id=lease.id, host_tier=True), SnapshotReply)
    await published(store, "peer")  # its copy's write hashed it: a peer beside the host tier's copy
    lease.numpy("uint8", (SIZE,))[SIZE // 2] ^= 0xFF  # one byte of a committed lease changed behind the digest
    source, got, last = await asyncio.to_thread(restore, m, "eng-b", 1)
    assert source == "host" and got == data
    assert any(lease.id in p and "does not match the peer's digest" in p for p in last["passed"]), last
    a.close()


async def _writer_open(fifo: Path) -> int:
    """The gate's write end, once the manager holds its read end: the peer is picked and held, not yet copied."""
    async def opened() -> int | None:
        with contextlib.suppress(OSError):
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        return None

    return await until(opened)


@pytest.mark.parametrize("how", ["released", "gpu_unhealthy"])
async def test_a_peer_lost_while_it_is_held_does_not_serve(how, manager_factory, bus, settings, tmp_path):
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_BYTES=str(8 * MIB),
                        HF_PEER_GATE=str(fifo), **SMALL_BLOCKS).start()
    a, lease, data = await asyncio.to_thread(load, m, "eng-a", 3, 0)
    await bus.request("node-1", SnapshotLease(lease_id=lease.id, host_tier=True), SnapshotReply)
    pending = asyncio.create_task(asyncio.to_thread(restore, m, "eng-b", 1))
    gate = await _writer_open(fifo)
    try:
        if how == "released":
            await asyncio.to_thread(a.release, lease.id)  # reclaimed: the manager frees its memory now
        else:
            reply = await bus.request(settings.node, SetGpuHealth(gpu=0, healthy=False, detail="XID 79 (test)"),
                                      SetGpuHealthReply)
            assert lease.id in reply.lost_leases
    finally:
        os.close(gate)  # the held copy goes on, then the peer is looked at again
    source, got, last = await pending
    assert source == "host" and got == data
    why = "reclaimed during the copy"
    assert any(lease.id in p and why in p for p in last["passed"]), last
    a.close()


def test_the_gate_fifo_is_not_open_without_a_reader(tmp_path):
    """The test's own premise: a FIFO's write end opens (non-blocking) only once a reader holds it."""
    fifo = tmp_path / "g"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as no_reader:
        os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    assert no_reader.value.errno == errno.ENXIO
