"""The one cold path (`safetensors_io.restore_or_load`) against a real gpu_manager on the host backend: a node copy
of the class's weights (host tier, else artifact) serves without a byte of the file being read (the file is gone);
a copy of another layout or a corrupt artifact is refused, its lease released, and the file read; no copy at all:
the file, nothing refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from libs.client.memory import MemoryClient
from libs.client.safetensors_io import WeightsLoad, restore_or_load
from libs.common.errors import NotFound
from tests.gpu_manager.harness import until

MIB = 1024 * 1024
TENSORS = {"a": np.arange(200_000, dtype=np.float32).reshape(400, 500), "b": np.ones((7, 9), dtype=np.float16)}
EXPECTED = {n: list(t.shape) for n, t in TENSORS.items()}


def weights_file(path: Path, tensors: dict[str, np.ndarray] = TENSORS) -> Path:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))
    return path


def cold_load(manager, engine_id: str, path: Path, expected=EXPECTED,  # noqa: ANN001
              keep: list | None = None) -> tuple[WeightsLoad, dict, list[str]]:
    """(the load, its tensors copied out, the ids of the leases the engine holds afterwards). The engine's leases
    are released at the end, as its exit would leave them: no live engine of the class is left to serve another's
    restore as a peer (test_peer_restore.py), so the node's copies are what serve here. `keep`: the client is
    appended there instead, its leases held (until `gone`)."""
    c = MemoryClient.connect(engine_id, socket_path=manager.socket, engine_class="cls")
    try:
        from engines.reference.weights import lease_filler

        # the filler as the engines pass it: asked only when the file is read (a copy served: the file may be gone)
        got = restore_or_load(c, path, copy="cls.weights", expected=expected, framework="numpy",
                              filler=lambda: lease_filler(path))
        out = got, {k: np.array(v) for k, v in got.tensors.items()}, sorted(c.leases)
    except BaseException:
        c.close()
        raise
    if keep is not None:
        keep.append(c)
    else:
        gone(c)
    return out


def gone(c: MemoryClient) -> None:
    for lease_id in list(c.leases):
        c.release(lease_id)
    c.close()


def host_copy_held(manager) -> bool:  # noqa: ANN001
    """Whether the node's host tier holds the class's copy (a restore from it alone, released at once)."""
    c = MemoryClient.connect("eng-probe", socket_path=manager.socket, engine_class="cls")
    try:
        lease = c.restore("cls.weights", sources=["host"])
        c.release(lease.id)
        return True
    except NotFound:
        return False
    finally:
        c.close()


def same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


async def test_a_host_copy_serves_with_the_file_gone_and_another_layout_is_refused(manager_factory, tmp_path):
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_CLASSES='["cls"]',
                        HF_HOST_TIER_BYTES=str(4 * MIB), HF_ARTIFACT_BLOCK_BYTES=str(MIB),
                        HF_ARTIFACT_FILE_BYTES=str(2 * MIB)).start()
    path = weights_file(tmp_path / "w.safetensors")
    kept: list[MemoryClient] = []
    first, tensors, _ = await asyncio.to_thread(cold_load, m, "eng-1", path, EXPECTED, kept)
    assert first.source == "file" and first.refused == "" and same(tensors, TENSORS)  # no copy yet: the file
    await until(lambda: asyncio.to_thread(host_copy_held, m))  # the policy copies the committed lease to the tier
    await asyncio.to_thread(gone, kept[0])  # the engine exits: its lease is no peer

    moved = path.rename(tmp_path / "elsewhere")  # from here on, any read of the file fails
    got, tensors, held = await asyncio.to_thread(cold_load, m, "eng-2", path)
    assert got.source == "host" and same(tensors, TENSORS) and len(held) == 1
    assert got.restore["bytes"] > 0 and got.load_ms > 0 and got.report()["source"] == "host"

    # The class's copy holds another model's layout: refused, its lease released, the file read.
    other = weights_file(path, {"a": np.zeros((3, 4), dtype=np.float32)})
    got, tensors, held = await asyncio.to_thread(cold_load, m, "eng-3", other, {"a": [3, 4]})
    assert got.source == "file" and got.refused.startswith("layout:") and "unexpected (e.g. b)" in got.refused
    assert np.array_equal(tensors["a"], np.zeros((3, 4), dtype=np.float32))
    assert len(held) == 1  # the refused copy's lease went back; only the file's lease is held
    moved.unlink()


async def test_a_corrupt_artifact_is_refused_and_the_file_read(manager_factory, tmp_path):
    artifacts = tmp_path / "a"
    m = manager_factory(HF_ARTIFACT_DIR=str(artifacts), HF_SNAPSHOT_CLASSES='["cls"]',
                        HF_ARTIFACT_BLOCK_BYTES=str(MIB), HF_ARTIFACT_FILE_BYTES=str(2 * MIB)).start()
    path = weights_file(tmp_path / "w.safetensors")
    kept: list[MemoryClient] = []
    await asyncio.to_thread(cold_load, m, "eng-1", path, EXPECTED, kept)
    await until(lambda: (artifacts / "cls.weights" / "manifest.json").exists())
    await asyncio.to_thread(gone, kept[0])  # the engine exits: its lease is no peer
    got, tensors, _ = await asyncio.to_thread(cold_load, m, "eng-2", path)
    assert got.source == "artifact" and same(tensors, TENSORS)

    with open(artifacts / "cls.weights" / "data-000.bin", "r+b") as f:
        f.write(b"\xff" * 16)
    got, tensors, held = await asyncio.to_thread(cold_load, m, "eng-3", path)
    assert got.source == "file" and got.refused.startswith("artifact_invalid") and same(tensors, TENSORS)
    assert len(held) == 1


async def test_a_drawn_weights_file_fills_a_leased_load_with_the_full_files_values(manager_factory, tmp_path):
    """A header-only weights file (make-weights --drawn): the cold path draws each tensor into its place in the new
    lease; the lease holds what the full file of the same seed holds, at the places the batched engine's plan gives."""
    import torch

    from engines.batched.memory import fused_plan, weights_plan
    from engines.reference.config import get_config
    from engines.reference.weights import lease_filler, load_weights, make_weights

    cfg = get_config("tiny")
    m = manager_factory().start()
    full = make_weights(cfg, tmp_path / "full.safetensors", seed=4)
    drawn = make_weights(cfg, tmp_path / "drawn.safetensors", seed=4, drawn=True)
    assert lease_filler(full) is None
    c = MemoryClient.connect("eng-drawn", socket_path=m.socket, engine_class="cls")
    try:
        got = await asyncio.to_thread(restore_or_load, c, drawn, copy=None, expected=cfg.tensor_shapes(),
                                      plan=fused_plan, filler=lambda: lease_filler(drawn))
        want = load_weights(full)
        assert got.source == "file" and set(got.tensors) == set(want)
        assert all(torch.equal(got.tensors[n], want[n]) for n in want)
        _, placed, _, _ = weights_plan(drawn, got.lease.id)  # the batched engine's own placement, kept
        assert sorted((m.name, m.offset) for m in got.metas) == sorted((n, off) for n, off, _, _ in placed)
    finally:
        gone(c)
