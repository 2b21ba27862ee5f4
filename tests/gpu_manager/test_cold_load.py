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
from tests.gpu_manager.harness import until

MIB = 1024 * 1024
TENSORS = {"a": np.arange(200_000, dtype=np.float32).reshape(400, 500), "b": np.ones((7, 9), dtype=np.float16)}
EXPECTED = {n: list(t.shape) for n, t in TENSORS.items()}


def weights_file(path: Path, tensors: dict[str, np.ndarray] = TENSORS) -> Path:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))
    return path


def cold_load(manager, engine_id: str, path: Path, expected=EXPECTED) -> tuple[WeightsLoad, dict, list[str]]:  # noqa: ANN001
    """(the load, its tensors copied out, the ids of the leases the engine holds afterwards)."""
    c = MemoryClient.connect(engine_id, socket_path=manager.socket, engine_class="cls")
    try:
        got = restore_or_load(c, path, copy="cls.weights", expected=expected, framework="numpy")
        return got, {k: np.array(v) for k, v in got.tensors.items()}, sorted(c.leases)
    finally:
        c.close()


def same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


async def test_a_host_copy_serves_with_the_file_gone_and_another_layout_is_refused(manager_factory, tmp_path):
    m = manager_factory(HF_ARTIFACT_DIR=str(tmp_path / "a"), HF_HOST_TIER_CLASSES='["cls"]',
                        HF_HOST_TIER_BYTES=str(4 * MIB), HF_ARTIFACT_BLOCK_BYTES=str(MIB),
                        HF_ARTIFACT_FILE_BYTES=str(2 * MIB)).start()
    path = weights_file(tmp_path / "w.safetensors")
    first, tensors, _ = await asyncio.to_thread(cold_load, m, "eng-1", path)
    assert first.source == "file" and first.refused == "" and same(tensors, TENSORS)  # no copy yet: the file

    async def tiered() -> bool:  # the policy copies the committed lease into the host tier
        return (await asyncio.to_thread(cold_load, m, "eng-probe", path))[0].source == "host"
    await until(tiered)

    gone = path.rename(tmp_path / "elsewhere")  # from here on, any read of the file fails
    got, tensors, held = await asyncio.to_thread(cold_load, m, "eng-2", path)
    assert got.source == "host" and same(tensors, TENSORS) and len(held) == 1
    assert got.restore["bytes"] > 0 and got.load_ms > 0 and got.report()["source"] == "host"

    # The class's copy holds another model's layout: refused, its lease released, the file read.
    other = weights_file(path, {"a": np.zeros((3, 4), dtype=np.float32)})
    got, tensors, held = await asyncio.to_thread(cold_load, m, "eng-3", other, {"a": [3, 4]})
    assert got.source == "file" and got.refused.startswith("layout:") and "unexpected (e.g. b)" in got.refused
    assert np.array_equal(tensors["a"], np.zeros((3, 4), dtype=np.float32))
    assert len(held) == 1  # the refused copy's lease went back; only the file's lease is held
    gone.unlink()


async def test_a_corrupt_artifact_is_refused_and_the_file_read(manager_factory, tmp_path):
    artifacts = tmp_path / "a"
    m = manager_factory(HF_ARTIFACT_DIR=str(artifacts), HF_SNAPSHOT_CLASSES='["cls"]',
                        HF_ARTIFACT_BLOCK_BYTES=str(MIB), HF_ARTIFACT_FILE_BYTES=str(2 * MIB)).start()
    path = weights_file(tmp_path / "w.safetensors")
    await asyncio.to_thread(cold_load, m, "eng-1", path)
    await until(lambda: (artifacts / "cls.weights" / "manifest.json").exists())
    got, tensors, _ = await asyncio.to_thread(cold_load, m, "eng-2", path)
    assert got.source == "artifact" and same(tensors, TENSORS)

    with open(artifacts / "cls.weights" / "data-000.bin", "r+b") as f:
        f.write(b"\xff" * 16)
    got, tensors, held = await asyncio.to_thread(cold_load, m, "eng-3", path)
    assert got.source == "file" and got.refused.startswith("artifact_invalid") and same(tensors, TENSORS)
    assert len(held) == 1
