"""Weights from a peer (issue 22, item 5): a restore served by copying a live lease of another engine on this node
that holds the same content, GPU to GPU, before the host tier and the artifact are tried (restore.py).

Identity. A lease's content is known only where its bytes were hashed: its `Digest` (the manifest's per-block
blake2b and root, with its tensors' layout apart from lease ids) is recorded when a copy is written from it
(`snapshot`: artifact or host tier), when it was itself filled by a restore (the source's manifest: every block
checked, or copied from a lease of that digest), or by a digest pass after its commit (`peer_classes`). A peer of
copy `name` is a lease with all of:
  - ACTIVE (its engine runs: not orphaned, frozen for a handover, sleeping or reclaimed), a committed weights lease
    whose default name (`<engine class>.<lease name>`) is `name`, not the requester's own, and not a host lease on
    a GPU backend;
  - on a healthy GPU of this node (the destination's own included: a copy within one GPU);
  - a digest whose layout is its committed layout now (a lease registered again after the digest has none) and
    whose size is its size;
  - where the node keeps a copy of `name` (host tier, else artifact: the reference), the reference's root digest,
    size and layout; where it keeps none, the same root as every other such peer (two that differ: neither).
A name alone is never enough: a lease with no digest is not a peer.

Invariants (tests/gpu_manager/test_peer_restore.py, test_peer_pick.py):
1. The peer is held while it is copied: under the book's lock its memory is duplicated (host: its memfds dup'd;
   cuda: its chunks mapped here, peer_cuda.py), so a reclaim meanwhile cannot free the pages under the copy.
2. Every block is copied whole; on the host backend each block's hash is checked against the digest before it
   counts (a peer written after its digest was taken is caught); on cuda the copy is device to device on the
   destination window's streams and synchronised before the lease is handed out (no hash: that would cost a
   device-to-host pass, the thing a peer copy avoids).
3. After the copy the peer is looked at again under the lock: gone, no longer ACTIVE, at another epoch or layout,
   or its GPU marked unhealthy meanwhile, and the copy does not count (`PeerLost`): the new lease is reclaimed and
   the next source (host tier, artifact, the engine's file) serves.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from libs.client.direct_io import read_exact, run_blocks
from libs.client.protocol import ArtifactInvalid, TensorMeta
from libs.common.errors import HoldfastError
from libs.common.events import LeaseState, Tag
from services.gpu_manager.artifact import Block, Manifest, block_digest, default_name, plan_blocks, rebase
from services.gpu_manager.records import LeaseRecord, layout_hash


class PeerLost(HoldfastError):
    """The peer changed under the copy (reclaimed, frozen, another epoch, its GPU failed): the copy does not count."""

    code = "peer_lost"


def neutral_layout(tensors: Iterable[TensorMeta]) -> str:
    """A layout hash that does not depend on which lease holds the tensors (records.layout_hash names the lease)."""
    return layout_hash(rebase(list(tensors), "-"))


@dataclass(frozen=True)
class Digest:
    """A lease's content as hashed: the manifest (blocks, root, tensors) and its tensors' lease-free layout."""

    manifest: Manifest
    layout: str

    @classmethod
    def of(cls, man: Manifest) -> Digest:
        return cls(man, neutral_layout(man.tensors))


@dataclass(frozen=True)
class Candidate:
    """What the pick looks at of one live lease (pure data, built under the book's lock)."""

    lease_id: str
    owner: str
    gpu: int
    epoch: int
    state: LeaseState
    tag: Tag
    name: str  # default name: <engine class>.<lease name>
    size: int
    layout: str | None  # neutral layout of its tensors when committed, else None
    healthy: bool
    eligible_memory: bool  # not a host lease on a GPU backend
    digest: Digest | None


def candidate(rec: LeaseRecord, *, healthy: bool, digest: Digest | None, gpu_backend: bool,
              layout: str | None) -> Candidate:
    """`layout`: `neutral_layout` of its tensors when committed, else None (the caller caches it per commit)."""
    info = rec.info
    return Candidate(info.id, info.owner, info.gpu, info.epoch, info.state, info.tag,
                     default_name(info.engine_class, info.name), info.size, layout, healthy,
                     not (info.host and gpu_backend), digest)


def _why_not(c: Candidate, name: str, requester: str, reference: Manifest | None) -> str | None:
    if c.name != name or c.tag != Tag.WEIGHTS:
        return "another copy"
    if c.owner == requester:
        return "the requester's own"
    if c.state != LeaseState.ACTIVE:
        return c.state.value.lower()
    if not c.eligible_memory:
        return "a host lease"
    if c.layout is None:
        return "not committed"
    if not c.healthy:
        return f"GPU {c.gpu} unhealthy"
    if c.digest is None:
        return "content never hashed"
    if c.digest.layout != c.layout or c.digest.manifest.size != c.size:
        return "registered again since its digest"
    if reference is not None and (reference.root != c.digest.manifest.root or reference.size != c.size
                                  or neutral_layout(reference.tensors) != c.layout):
        return f"content {c.digest.manifest.root[:12]} is not the node copy's {reference.root[:12]}"
    return None


def pick(cands: Sequence[Candidate], *, name: str, requester: str, gpu: int,
         reference: Manifest | None) -> tuple[Candidate | None, list[str]]:
    """The peer to copy `name` from onto `gpu`, and why each lease named so was passed (pure; the module's rules):
    the destination GPU's own first (a copy within one GPU), then the lowest GPU, then the lease id."""
    fit, passed = [], []
    for c in cands:
        why = _why_not(c, name, requester, reference)
        if why is None:
            fit.append(c)
        elif why != "another copy":
            passed.append(f"peer {c.lease_id} on GPU {c.gpu}: {why}")
    roots = {c.digest.manifest.root for c in fit if c.digest is not None}
    if reference is None and len(roots) > 1:
        passed.append(f"peers of {name} disagree ({len(roots)} contents) and the node keeps no copy to tell")
        return None, passed
    fit.sort(key=lambda c: (c.gpu != gpu, c.gpu, c.lease_id))
    return (fit[0] if fit else None), passed


def still_same(held: Candidate, rec: LeaseRecord | None, *, healthy: bool) -> str | None:
    """Invariant 3 (pure): why the copy from `held` no longer counts, None when the peer is as it was picked."""
    if rec is None or rec.info.state == LeaseState.RECLAIMED:
        return f"peer {held.lease_id} was reclaimed during the copy"
    if rec.info.state != LeaseState.ACTIVE:
        return f"peer {held.lease_id} became {rec.info.state.value.lower()} during the copy"
    if rec.info.epoch != held.epoch or rec.info.layout_hash is None or \
            neutral_layout(rec.tensors.values()) != held.layout:
        return f"peer {held.lease_id} changed hands or layout during the copy"
    if not healthy:
        return f"peer {held.lease_id}'s GPU {held.gpu} was marked unhealthy during the copy"
    return None


# ------------------------------------------------------------ the host backend's copy (blocking: off the loop)


@dataclass
class HeldHost:
    """The peer's memfds, duplicated under the book's lock (invariant 1), and their sizes."""

    fds: list[int]
    sizes: list[int]

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def segments(block: Block, sizes: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(chunk, offset in the chunk, offset in the block, bytes) covering `block` over chunks of `sizes` (pure)."""
    out, start = [], 0
    for i, size in enumerate(sizes):
        lo, hi = max(block.offset, start), min(block.offset + block.nbytes, start + size)
        if lo < hi:
            out.append((i, lo - start, lo - block.offset, hi - lo))
        start += size
    if sum(n for *_, n in out) != block.nbytes:
        raise ArtifactInvalid(f"peer holds {start} bytes: block {block.index} ends past it")
    return out


def copy_host(window: Any, held: HeldHost, man: Manifest, *, workers: int) -> float:
    """Every block of the peer into the window, each checked against the digest before it counts (invariant 2);
    preadv from the peer's memfds straight into the new lease's pages, blocks on `workers` threads."""
    t0 = time.perf_counter()
    blocks = plan_blocks(man.size, man.block_bytes, man.file_bytes)

    def step(worker: int, block: Block) -> None:
        buf = window.buffer(worker, block)
        for chunk, at, into, n in segments(block, held.sizes):
            read_exact(held.fds[chunk], buf[into:into + n], at, f"peer copy of {man.name}")
        if block_digest(buf) != man.blocks[block.index]:
            raise ArtifactInvalid(f"peer copy of {man.name}: block {block.index} does not match the peer's digest "
                                  "(written since it was hashed)")
        window.done(worker, block, buf)

    run_blocks(blocks, workers, step)
    window.finish()
    return time.perf_counter() - t0


def hash_lease(window: Any, size: int, block_bytes: int, file_bytes: int, *, workers: int) -> list[str]:
    """Each block's digest of a mapped lease (the digest pass after a commit: `peer_classes`)."""
    blocks = plan_blocks(size, block_bytes, file_bytes)
    digests = [""] * len(blocks)

    def step(worker: int, block: Block) -> None:
        buf = window.buffer(worker, block)
        digests[block.index] = block_digest(buf)
        window.done(worker, block, buf)

    run_blocks(blocks, workers, step)
    window.finish()
    return digests


def wait_at_gate(path: str) -> None:
    """Tests only (`peer_gate`): block until a writer opens and closes the FIFO at `path`, so a test can change the
    peer while it is held and before its blocks are copied."""
    if path:
        with open(path, "rb") as f:
            f.read()
