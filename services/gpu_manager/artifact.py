"""The weight artifact's format: a lease's bytes as they sit in memory, in files laid out for direct I/O, and a
manifest written last. Pure layout and hashing, plus the manifest's read and atomic write (small files).

    <artifact_dir>/<name>/data-000.bin ...   the lease's bytes, back to back, `file_bytes` per file
    <artifact_dir>/<name>/manifest.json       format, lease shape, tensors, per-block hashes, root hash

Invariants (checked by tests/gpu_manager/test_artifact.py):
1. Every file size, every block's offset and length is a multiple of ALIGN (lease sizes are multiples of the
   backend's granularity, >= 4 KiB), so every read and write can be O_DIRECT.
2. The manifest is written (fsynced, renamed) only after every data file is fsynced: a directory without it is
   an unfinished artifact and is refused (`ArtifactInvalid`), never half-restored.
3. A block's bytes hash to the manifest's digest of that block, and the root hash covers the block digests in
   order, the sizes and the tensors the bytes hold (offsets, shapes, dtypes, strides: `root_digest`): a flipped
   byte anywhere, a short file, a reordered block or an edited tensor table is refused, and so is a tensor past
   the lease's end.
4. An artifact is read only from files and directories of the manager's own uid that no one else may write
   (`check_private`), never through a symbolic link: the digests are unkeyed (anyone can recompute them), so the
   trust in a copy is who could have written it. A careless `--artifact-dir` (0777, shared) is refused, named.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from libs.client.protocol import ArtifactInvalid, TensorMeta, tensor_extent
from libs.client.safetensors_io import copy_name
from libs.common.errors import MalformedMessage, NotFound
from libs.common.private_path import not_private

FORMAT_VERSION = 2  # 2: the root hash covers the tensor table (1 covered the block digests alone)
ALIGN = 4096  # the largest logical block size of common devices: O_DIRECT offsets, lengths, buffers
BLOCK_BYTES = 64 * 1024 * 1024  # unit of I/O and of hashing: big enough to stream, small enough to spread
FILE_BYTES = 4 * 1024 * 1024 * 1024  # several files: a striped filesystem serves them from several servers
HASH = "blake2b-128"  # hashlib, no new dependency; per block, so blocks are hashed on many threads at once
MANIFEST = "manifest.json"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    bytes: int = Field(ge=0)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int
    name: str
    size: int = Field(gt=0)  # the lease's bytes
    tag: str
    lease_name: str
    engine_class: str
    source_lease: str
    layout_hash: str | None
    tensors: list[TensorMeta]  # lease_id is the source lease's; a restore rebases them onto the new lease
    block_bytes: int = Field(gt=0)
    file_bytes: int = Field(gt=0)
    files: list[FileEntry]
    hash: str
    blocks: list[str]  # hex digest of each block, in lease order
    root: str
    node: str
    created_at: float
    write_s: float


@dataclass(frozen=True)
class Block:
    """One unit of I/O: lease bytes [offset, offset + nbytes) stored at `file_offset` of file `file`."""

    index: int
    offset: int
    nbytes: int
    file: int
    file_offset: int


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise MalformedMessage(f"artifact name {name!r}: letters, digits, '.', '_' or '-' (not first), <= 200")
    return name


# The artifact a class's weights lease is written to by default (policy, `snapshot`): the very name its engines
# ask to restore, by one rule.
default_name = copy_name


def plan_blocks(size: int, block_bytes: int = BLOCK_BYTES, file_bytes: int = FILE_BYTES) -> list[Block]:
    """The blocks of a lease of `size` bytes (invariant 1): files hold whole blocks, blocks never straddle files."""
    if size % ALIGN or block_bytes % ALIGN or file_bytes % block_bytes:
        raise ValueError(f"size {size}, block {block_bytes}, file {file_bytes}: not aligned to {ALIGN} / blocks")
    out = []
    for i, offset in enumerate(range(0, size, block_bytes)):
        out.append(Block(i, offset, min(block_bytes, size - offset), offset // file_bytes, offset % file_bytes))
    return out


def file_names(size: int, file_bytes: int) -> list[FileEntry]:
    count = max(1, -(-size // file_bytes))
    return [FileEntry(name=f"data-{i:03d}.bin", bytes=min(file_bytes, size - i * file_bytes)) for i in range(count)]


def block_digest(data: memoryview | bytes) -> str:
    """One block's digest. hashlib releases the GIL on large buffers: threads hash blocks in parallel."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def root_digest(blocks: list[str], size: int, block_bytes: int, file_bytes: int, tensors: list[TensorMeta]) -> str:
    """The copy's identity (invariant 3): its bytes and the tensors they hold, whichever lease held them (the lease
    id left out: two leases of one model's bytes and layout have one root, which is what a peer is matched on)."""
    table = sorted(({**t.model_dump(mode="json"), "lease_id": "-"} for t in tensors), key=lambda d: d["name"])
    canon = json.dumps({"blocks": blocks, "size": size, "block_bytes": block_bytes, "file_bytes": file_bytes,
                        "tensors": table}, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canon.encode(), digest_size=16).hexdigest()


def check_private(path: Path, what: str) -> os.stat_result:
    """`path`'s lstat if it is the manager's uid's, no one else may write it and it is no symbolic link (invariant
    4); else ArtifactInvalid naming what is wrong (a file that is not there: FileNotFoundError)."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        raise ArtifactInvalid(f"{what} {path} is a symbolic link: an artifact is read only from its own files")
    if (why := not_private(st)) is not None:
        raise ArtifactInvalid(f"{what} {path} {why}: anyone with that access could have planted its bytes; make it "
                              "the manager's alone (chown, chmod go-w)")
    return st


def _check_tensors(path: Path, man: Manifest) -> None:
    """Invariant 3's tensor table, as the manager's registration checks one: each tensor well formed, the source
    lease's, and within the copy (a table with its root hash made again would be placed past the new lease). The
    layout hash is not the table's to match: an engine's commit hashes the tensors of all its leases at once."""
    for t in man.tensors:
        try:
            end = t.offset + tensor_extent(t)
        except MalformedMessage as e:
            raise ArtifactInvalid(f"{path}: {e}") from None
        if t.lease_id != man.source_lease or end > man.size:
            raise ArtifactInvalid(f"{path}: tensor {t.name} lies outside the copy ({end} > {man.size} bytes, or "
                                  f"another lease's: {t.lease_id})")


def artifact_path(root: Path, name: str) -> Path:
    return root / check_name(name)


def read_manifest(directory: Path) -> Manifest:
    """The manifest of a finished artifact whose files are all there at their full size (invariant 2), or
    `NotFound` (no such artifact) / `ArtifactInvalid` (unfinished, truncated, another version, inconsistent)."""
    if not directory.is_dir():
        raise NotFound(f"no artifact at {directory}")
    check_private(directory.parent, "the artifact directory")
    check_private(directory, "artifact")
    path = directory / MANIFEST
    try:
        check_private(path, "manifest")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ArtifactInvalid(f"{directory}: no manifest (the artifact was never finished)") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read()
    try:
        man = Manifest.model_validate_json(raw)
    except ValidationError as e:
        raise ArtifactInvalid(f"{path}: unreadable manifest ({e.error_count()} errors)") from None
    if man.version != FORMAT_VERSION or man.hash != HASH:
        raise ArtifactInvalid(f"{path}: format {man.version}/{man.hash}, this manager reads {FORMAT_VERSION}/{HASH}")
    blocks = plan_blocks(man.size, man.block_bytes, man.file_bytes)
    if len(blocks) != len(man.blocks) or root_digest(man.blocks, man.size, man.block_bytes, man.file_bytes,
                                                     man.tensors) != man.root:
        raise ArtifactInvalid(f"{path}: its blocks or tensor table do not match its size or root hash")
    _check_tensors(path, man)
    if man.files != file_names(man.size, man.file_bytes):
        raise ArtifactInvalid(f"{path}: file list does not match the lease size")
    for entry in man.files:
        try:
            have = check_private(directory / entry.name, "artifact file").st_size
        except FileNotFoundError:
            raise ArtifactInvalid(f"{directory}: {entry.name} is missing") from None
        if have != entry.bytes:
            raise ArtifactInvalid(f"{directory}: {entry.name} holds {have} bytes, the manifest says {entry.bytes} "
                                  "(truncated or overwritten)")
    return man


def write_manifest(directory: Path, man: Manifest) -> None:
    """Atomically: temporary file, fsync, rename, fsync of the directory (invariant 2: the last write)."""
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(man.model_dump(mode="json"), separators=(",", ":")))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rebase(tensors: list[TensorMeta], lease_id: str) -> list[TensorMeta]:
    """The artifact's tensors on a new lease (same offsets: the bytes sit where they sat)."""
    return [t.model_copy(update={"lease_id": lease_id}) for t in tensors]
