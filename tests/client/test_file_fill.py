"""A lease filled from ranges of a file (libs/client/file_fill.py): the reads' plan (pure), then real files read into
real memfd leases (O_DIRECT on the test's disk, buffered where the filesystem refuses it), a truncated file refused;
and on a GPU (marked `gpu`) the same through pinned buffers into VMM chunks, checked against safetensors' reader."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from devstack.pagecache import drop_cache
from libs.client.direct_io import ALIGN, resident_share
from libs.client.file_fill import CACHED_SHARE, Piece, fill_from_file, plan_reads
from libs.client.mapping import HostMapping
from libs.common.errors import MalformedMessage
from libs.common.gpu import has_gpu

KIB, MIB = 1024, 1024 * 1024


def random_ranges(rng: random.Random, n: int, *, start: int) -> list[tuple[int, int, int]]:
    """n back-to-back ranges of a file from an unaligned `start` (as a safetensors data region), placed in the
    lease in another order at 256-byte aligned offsets, some empty."""
    sizes = [rng.choice([0, 1, 7, 255, 4096, 5000, 70_000, 300_000]) for _ in range(n)]
    offsets, at = [], start
    for s in sizes:
        offsets.append(at)
        at += s
    order, lease_at, placed = list(range(n)), 0, {}
    rng.shuffle(order)
    for i in order:
        placed[i] = lease_at
        lease_at += -(-sizes[i] // 256) * 256
    return [(offsets[i], placed[i], sizes[i]) for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_covers_every_byte_once_with_aligned_blocks_in_file_order(seed: int):
    rng = random.Random(seed)
    ranges = random_ranges(rng, 40, start=8 + rng.randrange(1, 3000))
    if seed % 2:  # two extents apart: the gap between them is not read
        ranges += [(f + 50 * MIB, lease + 50 * MIB, n) for f, lease, n in ranges[:5]]
    block = rng.choice([4 * KIB, 64 * KIB, 1 * MIB])
    blocks = plan_reads(ranges, block)
    last_end = -1
    for b in blocks:
        assert b.file_offset % ALIGN == 0 and b.nbytes % ALIGN == 0 and 0 < b.nbytes <= block
        assert b.file_offset >= last_end  # in file order, no overlap
        last_end = b.file_offset + b.nbytes
        assert b.pieces and b.need == max(p.buf_offset + p.nbytes for p in b.pieces) <= b.nbytes
    covered = sum(p.nbytes for b in blocks for p in b.pieces)
    assert covered == sum(n for _, _, n in ranges)  # each byte once: pieces never overlap within a range
    for f, lease, n in ranges:  # a range's pieces, in order, are its bytes back to back
        got = sorted((b.file_offset + p.buf_offset, p.lease_offset, p.nbytes) for b in blocks for p in b.pieces
                     if lease <= p.lease_offset < lease + n)
        at = f
        for file_at, lease_at, size in got:
            assert file_at == at and lease_at == lease + (at - f)
            at += size
        assert at == f + n
    if seed % 2:
        assert sum(b.nbytes for b in blocks) < 50 * MIB  # the gap was skipped


def test_a_bad_block_size_is_refused_and_nothing_to_read_plans_nothing():
    with pytest.raises(ValueError, match="multiple"):
        plan_reads([(0, 0, 10)], 1000)
    assert plan_reads([(5, 0, 0)]) == []
    # two bytes across an aligned boundary: two blocks, one byte each
    assert [(b.file_offset, b.need, b.pieces) for b in plan_reads([(4095, 0, 2)], 4096)] == \
        [(0, 4096, (Piece(4095, 0, 1),)), (4096, 1, (Piece(0, 1, 1),))]


def lease(size: int) -> HostMapping:
    fd = os.memfd_create("test-fill", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    m = HostMapping([fd], [size])
    os.close(fd)
    return m


def fill_and_check(path: Path, data: bytes, ranges: list[tuple[int, int, int]], *, workers: int,
                   block: int) -> bool:
    size = max(lease_at + n for _, lease_at, n in ranges) + 4096
    m = lease(size)
    try:
        direct = fill_from_file(m, path, ranges, workers=workers, block_bytes=block)
        got = bytes(m.buffer(0, size))
        for f, lease_at, n in ranges:
            assert got[lease_at:lease_at + n] == data[f:f + n]
    finally:
        m.unmap()
    return direct


@pytest.mark.parametrize("workers, block", [(1, 64 * KIB), (4, 64 * KIB), (3, 1 * MIB)])
def test_a_file_fills_a_memfd_lease_with_o_direct_reads(tmp_path: Path, workers: int, block: int):
    rng = random.Random(workers * block)
    ranges = random_ranges(rng, 60, start=8 + 1234)
    end = max(f + n for f, _, n in ranges)
    data = np.random.default_rng(1).integers(0, 256, end + 321, dtype=np.uint8).tobytes()  # ends unaligned
    (tmp_path / "w.bin").write_bytes(data)
    drop_cache([tmp_path / "w.bin"])  # not in the page cache: read from the disk, which takes O_DIRECT
    assert fill_and_check(tmp_path / "w.bin", data, ranges, workers=workers, block=block)


def test_a_file_in_the_page_cache_is_read_buffered_and_one_on_disk_direct(tmp_path: Path):
    """Cached pages come at memory speed only through the cache: a file mostly cached is read buffered."""
    rng = random.Random(5)
    ranges = random_ranges(rng, 30, start=8 + 99)
    end = max(f + n for f, _, n in ranges)
    data = np.random.default_rng(3).integers(0, 256, end, dtype=np.uint8).tobytes()
    path = tmp_path / "w.bin"
    path.write_bytes(data)
    os.sync()
    drop_cache([path])
    assert resident_share(path) < CACHED_SHARE
    assert fill_and_check(path, data, ranges, workers=2, block=64 * KIB)  # O_DIRECT: the cache stays cold
    assert resident_share(path) < CACHED_SHARE
    assert path.read_bytes() == data  # a buffered read brings it in
    assert resident_share(path) == 1.0
    assert not fill_and_check(path, data, ranges, workers=2, block=64 * KIB)


def test_a_file_in_memory_fills_a_lease_too():
    """/dev/shm (tmpfs), where weights are often put for speed: older kernels refuse O_DIRECT there (then the reads
    are buffered), newer ones take it; the bytes are the same either way."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm (tmpfs) here")
    rng = random.Random(9)
    ranges = random_ranges(rng, 20, start=8 + 77)
    end = max(f + n for f, _, n in ranges)
    data = np.random.default_rng(2).integers(0, 256, end, dtype=np.uint8).tobytes()
    path = Path("/dev/shm") / f"hf-test-fill-{os.getpid()}"
    path.write_bytes(data)
    try:
        fill_and_check(path, data, ranges, workers=2, block=64 * KIB)
    finally:
        path.unlink()


def test_a_truncated_file_is_refused(tmp_path: Path):
    ranges = [(100, 0, 200_000), (200_100, 200_192, 300_000)]
    data = bytes(range(256)) * 1000  # 256,000 bytes: the second range runs past the end
    (tmp_path / "short.bin").write_bytes(data)
    m = lease(1 * MIB)
    try:
        with pytest.raises(MalformedMessage, match="truncated"):
            fill_from_file(m, tmp_path / "short.bin", ranges, workers=2, block_bytes=64 * KIB)
    finally:
        m.unmap()


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
def test_cuda_a_safetensors_file_fills_vmm_chunks_as_safetensors_reads_it(manager_factory, tmp_path: Path):
    """The engines' cold path on a real GPU: a file larger than one 64 MiB block, its tensors laid out in reverse
    order, through a gpu_manager's VMM lease; every tensor equal to safetensors' own read of the file."""
    import torch
    from safetensors.torch import load_file, save_file

    from libs.client.memory import MemoryClient
    from libs.client.safetensors_io import load_file_into_lease, plan_layout

    g = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randint(-30000, 30000, (n,), generator=g, dtype=torch.int16).to(torch.bfloat16)
               for i, n in enumerate([3, 40_000_000, 1_000_001, 17, 30_000_000, 4097])}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    m = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="128").start()
    c = MemoryClient.connect("eng-fill", socket_path=m.socket)
    try:
        def reverse(header: dict, lease_id: str):  # noqa: ANN202 - the engines' `plan`, another order
            return plan_layout(header, lease_id, order=sorted(header, reverse=True))

        lease, metas = load_file_into_lease(c, tmp_path / "w.safetensors", plan=reverse)
        want = load_file(str(tmp_path / "w.safetensors"), device="cuda:0")
        for meta in metas:
            got = lease.view(meta, "torch")
            assert torch.equal(got, want[meta.name]), meta.name
    finally:
        c.close()
