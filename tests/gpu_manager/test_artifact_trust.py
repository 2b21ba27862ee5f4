"""What an artifact vouches for, against a careless or hostile party on the node (probe of 2026-12-07): its tensor
table is part of its root hash (swapped offsets of two same-shaped tensors, an edited dtype, a tensor past the
lease were restored and served: wrong tokens, nothing said); it is read only from files and directories of the
manager's uid that no one else may write, never through a link (planted bytes with recomputed digests in a 0777
directory were served); a write cut off by a SIGKILL leaves nothing for good (a whole lease's bytes, kept). A real
gpu_manager on the host backend; every refusal falls back to the file in `load_weights` (artifact_invalid)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from libs.client.memory import MemoryClient
from libs.client.protocol import ArtifactInvalid, TensorMeta
from libs.common.events import SnapshotLease, SnapshotReply
from services.gpu_manager.artifact import block_digest, read_manifest, root_digest
from tests.gpu_manager.test_artifact import MIB, NODE, SIZE, lease_bytes, load_lease

NOBODY = 65534


def _edit(manifest: Path, change) -> None:  # noqa: ANN001
    man = json.loads(manifest.read_text())
    change(man)
    manifest.write_text(json.dumps(man))


def _restore(manager, engine_id: str, name: str):  # noqa: ANN001, ANN202
    client = MemoryClient.connect(engine_id, socket_path=manager.socket)
    try:
        lease = client.restore(name)
        return lease_bytes(lease), {m.name: (m.offset, m.dtype) for m in lease.tensor_metas}
    finally:
        client.close()


async def test_an_edited_tensor_table_is_refused_even_with_its_layout_hash_recomputed(copies_manager, bus, artifacts):
    src, lease_id, data = await asyncio.to_thread(load_lease, copies_manager, "eng-src", 3)
    await bus.request(NODE, SnapshotLease(lease_id=lease_id, artifact="m"), SnapshotReply, timeout=30)
    manifest = artifacts / "m" / "manifest.json"
    pristine = manifest.read_text()

    def swap(man: dict) -> None:  # "a" moved where "b" starts: same bytes, other tensors
        man["tensors"][0]["offset"], man["tensors"][1]["offset"] = MIB, 0

    def dtype(man: dict) -> None:
        man["tensors"][0]["dtype"] = "int32"

    def past_end(man: dict) -> None:
        man["tensors"][1]["offset"] = SIZE

    def forged(man: dict) -> None:  # a forger's table with its root made again: a tensor past the lease's end
        past_end(man)
        man["root"] = root_digest(man["blocks"], man["size"], man["block_bytes"], man["file_bytes"],
                                  [TensorMeta.model_validate(t) for t in man["tensors"]])

    for change, why in ((swap, "tensor table do not match"), (dtype, "tensor table do not match"),
                        (past_end, "tensor table do not match"), (forged, "tensor b lies outside the copy")):
        manifest.write_text(pristine)
        _edit(manifest, change)
        with pytest.raises(ArtifactInvalid, match=why):
            await asyncio.to_thread(_restore, copies_manager, "eng-cold", "m")
    manifest.write_text(pristine)
    got, tensors = await asyncio.to_thread(_restore, copies_manager, "eng-cold", "m")
    assert got == data and tensors == {"a": (0, "float32"), "b": (MIB, "uint8")}
    src.close()


async def test_an_artifact_others_could_write_is_refused_however_well_its_digests_match(copies_manager, bus,
                                                                                          artifacts):
    src, lease_id, data = await asyncio.to_thread(load_lease, copies_manager, "eng-src", 4)
    await bus.request(NODE, SnapshotLease(lease_id=lease_id, artifact="m"), SnapshotReply, timeout=30)
    d, manifest = artifacts / "m", artifacts / "m" / "manifest.json"
    assert (artifacts.stat().st_mode & 0o777, d.stat().st_mode & 0o777, manifest.stat().st_mode & 0o777) == (
        0o700, 0o700, 0o600)  # as the manager writes them

    # a planted byte with every digest recomputed by the public functions: a match, but anyone could have made it
    with open(d / "data-000.bin", "r+b") as f:
        f.write(b"\x7f")
        f.seek(0)
        first = f.read(MIB)
    man = json.loads(manifest.read_text())
    man["blocks"][0] = block_digest(first)
    man["root"] = root_digest(man["blocks"], man["size"], man["block_bytes"], man["file_bytes"],
                              [TensorMeta.model_validate(t) for t in man["tensors"]])
    manifest.write_text(json.dumps(man))
    for path, how, why in ((artifacts, "chmod", "artifact directory .* may be written by others"),
                           (d, "chmod", "artifact .* may be written by others"),
                           (d / "data-001.bin", "chmod", "artifact file .* may be written by others"),
                           (manifest, "chown", "manifest .* belongs to uid 65534"),
                           (d / "data-000.bin", "chown", "artifact file .* belongs to uid 65534")):
        mode, st = path.stat().st_mode & 0o7777, path.stat()
        if how == "chmod":
            path.chmod(mode | 0o022)
        elif os.geteuid() == 0:
            os.chown(path, NOBODY, NOBODY)
        else:
            continue  # giving a file away needs root
        with pytest.raises(ArtifactInvalid, match=why):
            await asyncio.to_thread(_restore, copies_manager, "eng-cold", "m")
        path.chmod(mode)
        if how == "chown":
            os.chown(path, st.st_uid, st.st_gid)
    got, _ = await asyncio.to_thread(_restore, copies_manager, "eng-cold", "m")  # ours, closed: its bytes served
    assert got[:1] == b"\x7f" and got[1:] == data[1:]

    real = d / "data-002.bin"  # a data file replaced by a link to a file of the same bytes
    (artifacts / "elsewhere.bin").write_bytes(real.read_bytes())
    real.unlink()
    real.symlink_to(artifacts / "elsewhere.bin")
    with pytest.raises(ArtifactInvalid, match="symbolic link"):
        await asyncio.to_thread(_restore, copies_manager, "eng-cold", "m")
    src.close()


async def test_a_write_killed_mid_way_leaves_nothing_once_the_manager_is_back(manager_factory, artifacts, bus):
    """A SIGKILL mid-write left `.<name>.partial-*` (and between the two renames `.old-*`), a whole lease's bytes
    each, for good. The restarted manager sweeps its own node's; another node's (a shared directory) it leaves."""
    env = dict(HF_ARTIFACT_DIR=str(artifacts), HF_ARTIFACT_BLOCK_BYTES=str(MIB), HF_ARTIFACT_FILE_BYTES=str(2 * MIB))
    first = manager_factory(**env).start()
    src, lease_id, _ = await asyncio.to_thread(load_lease, first, "eng-src", 5)
    await bus.request(NODE, SnapshotLease(lease_id=lease_id, artifact="m"), SnapshotReply, timeout=30)
    src.close()
    left = [artifacts / f".m.partial-{NODE}-0123abcd", artifacts / f".m.old-{NODE}-4567cdef"]
    theirs = artifacts / ".m.partial-node-2-89abcdef"
    for d in [*left, theirs]:  # as a kill leaves them: files of a write in progress
        d.mkdir(mode=0o700)
        (d / "data-000.bin").write_bytes(b"\0" * MIB)
    first.kill()  # SIGKILL
    await asyncio.to_thread(first.start)
    assert not any(d.exists() for d in left) and theirs.is_dir()
    assert read_manifest(artifacts / "m").name == "m"  # the finished artifact stays
