"""Parallel block I/O (blockio.py) in this process, on memfds: O_DIRECT where the filesystem takes it and its
fallback where it does not (tmpfs), a truncated file and a corrupt block refused before the block is handed on."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from libs.client.direct_io import open_files
from libs.client.protocol import ArtifactInvalid
from services.gpu_manager.artifact import ALIGN, Block, file_names, plan_blocks
from services.gpu_manager.blockio import HostWindow, read_blocks, write_blocks

MIB = 1024 * 1024


def memfds(sizes: list[int]) -> list[int]:
    fds = []
    for i, size in enumerate(sizes):
        fd = os.memfd_create(f"test-{i}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        fds.append(fd)
    return fds


def fill(window: HostWindow, size: int, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    np.frombuffer(window.mapping.buffer(0, size), dtype=np.uint8)[:] = data
    return data.tobytes()


def write_then_read(directory: Path, *, direct: bool, size: int = 5 * MIB, block: int = MIB, per_file: int = 2 * MIB):
    sizes = [MIB] * (size // MIB)
    src = HostWindow(memfds(sizes), sizes, read_only=False)
    expected = fill(src, size, 7)
    entries = file_names(size, per_file)
    blocks = plan_blocks(size, block, per_file)
    out = open_files([directory / e.name for e in entries], write=True, direct=direct, sizes=[e.bytes for e in entries])
    digests = write_blocks(out, blocks, src, workers=3)
    out.close()
    dst = HostWindow(memfds(sizes), sizes, read_only=False)
    inp = open_files([directory / e.name for e in entries], write=False, direct=direct)
    read_blocks(inp, blocks, dst, workers=3, digests=digests, what="test")
    inp.close()
    got = bytes(dst.mapping.buffer(0, size))
    src.close()
    dst.close()
    return expected, got, out, inp, digests, blocks, entries


def test_blocks_are_aligned_and_never_straddle_a_file():
    blocks = plan_blocks(10 * MIB + 8 * ALIGN, MIB, 4 * MIB)
    assert sum(b.nbytes for b in blocks) == 10 * MIB + 8 * ALIGN
    for b in blocks:
        assert b.offset % ALIGN == 0 and b.nbytes % ALIGN == 0 and b.file_offset % ALIGN == 0
        assert b.file_offset + b.nbytes <= 4 * MIB and b.file == b.offset // (4 * MIB)
    with pytest.raises(ValueError):
        plan_blocks(MIB + 1, MIB, 4 * MIB)


def test_a_round_trip_through_o_direct_files_gives_the_same_bytes(tmp_path: Path):
    expected, got, out, inp, *_ , entries = write_then_read(tmp_path, direct=True)
    assert got == expected
    assert [p.stat().st_size for p in sorted(tmp_path.iterdir())] == [e.bytes for e in entries]
    assert len(entries) == 3
    assert out.direct and inp.direct  # the test's tmp dir is on a disk filesystem that takes O_DIRECT


def test_an_o_direct_read_the_kernel_refuses_falls_back_to_buffered_io(tmp_path: Path):
    """A filesystem that takes O_DIRECT at open may still refuse the I/O (EINVAL); here the kernel's own refusal
    of a misaligned buffer stands in for it: the read turns O_DIRECT off on that fd and completes."""
    import fcntl

    from libs.client.direct_io import O_DIRECT, read_exact

    (tmp_path / "f").write_bytes(bytes(range(256)) * 64)
    files = open_files([tmp_path / "f"], write=False, direct=True)
    assert files.direct and fcntl.fcntl(files.fds[0], fcntl.F_GETFL) & O_DIRECT
    raw = bytearray(ALIGN + 1)
    buf = memoryview(raw)[1:]  # misaligned: O_DIRECT refuses it
    read_exact(files.fds[0], buf, 0, "test")
    assert bytes(buf) == (bytes(range(256)) * 64)[:ALIGN]
    assert not fcntl.fcntl(files.fds[0], fcntl.F_GETFL) & O_DIRECT
    files.close()


def test_a_round_trip_through_tmpfs_gives_the_same_bytes():
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        expected, got, out, *_ = write_then_read(Path(d), direct=True)
    assert got == expected  # O_DIRECT where this kernel's tmpfs takes it (>= 6.6), else buffered (out.fallbacks)


def test_a_truncated_file_is_refused(tmp_path: Path):
    _, _, _, _, digests, blocks, entries = write_then_read(tmp_path, direct=True)
    os.truncate(tmp_path / entries[-1].name, 0)
    sizes = [MIB] * 5
    dst = HostWindow(memfds(sizes), sizes, read_only=False)
    inp = open_files([tmp_path / e.name for e in entries], write=False, direct=True)
    with pytest.raises(ArtifactInvalid, match="truncated"):
        read_blocks(inp, blocks, dst, workers=2, digests=digests, what="test")
    inp.close()
    dst.close()


def test_a_corrupt_block_is_refused_before_it_is_handed_on(tmp_path: Path):
    _, _, _, _, digests, blocks, entries = write_then_read(tmp_path, direct=False)
    with open(tmp_path / entries[1].name, "r+b") as f:  # block 2 is the first of file 1
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    sizes = [MIB] * 5
    handed: list[int] = []

    class Watching(HostWindow):
        def done(self, worker: int, block: Block, buf: memoryview) -> None:
            handed.append(block.index)
            super().done(worker, block, buf)

    dst = Watching(memfds(sizes), sizes, read_only=False)
    inp = open_files([tmp_path / e.name for e in entries], write=False, direct=False)
    with pytest.raises(ArtifactInvalid, match=r"block 2 .*\(corrupt\)"):
        read_blocks(inp, blocks, dst, workers=1, digests=digests, what="test")
    assert 2 not in handed
    inp.close()
    dst.close()
