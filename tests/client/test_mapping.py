"""The host mapping's invariants (libs/client/mapping.py), on real memfds and real mmaps: chunks become one range,
a failed fill leaves nothing reserved, a placeholder's range adopts exactly its size of chunks and nothing else."""

from __future__ import annotations

import os

import pytest

from libs.client.mapping import HostMapping
from libs.common.errors import HoldfastError

PAGE = os.sysconf("SC_PAGE_SIZE")


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("hf-test-chunk", os.MFD_CLOEXEC)
    os.ftruncate(fd, len(data))
    os.pwrite(fd, data, 0)
    return fd


def _vm_size_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))


def test_chunks_are_mapped_back_to_back_and_writes_reach_the_shared_memory():
    a, b = _memfd(b"a" * PAGE), _memfd(b"b" * 2 * PAGE)
    m = HostMapping([a, b], [PAGE, 2 * PAGE])
    try:
        view = m.buffer(0, 3 * PAGE)
        assert bytes(view[PAGE - 1:PAGE + 1]) == b"ab" and m.size == 3 * PAGE and m.ptr == m.base
        view[PAGE] = ord("z")
        assert os.pread(b, 1, 0) == b"z"
        with pytest.raises(HoldfastError, match="outside the lease"):
            m.buffer(PAGE, 3 * PAGE)
    finally:
        m.unmap()
        os.close(a)
        os.close(b)
    assert m.base == 0
    m.unmap()  # a second unmap is a no-op


def test_a_chunk_that_cannot_be_mapped_leaves_no_reserved_range_behind():
    huge = 1 << 40  # reserved (PROT_NONE, NORESERVE) before the chunk fails: a leak would show in VmSize
    before = _vm_size_kib()
    with pytest.raises(OSError):
        HostMapping([-1], [huge])
    assert _vm_size_kib() - before < (huge >> 10) // 2


def test_a_placeholder_backs_the_whole_range_with_one_memory_and_gives_way_to_chunks_of_its_size():
    m = HostMapping.placeholder(4 * PAGE, PAGE)
    fds = [_memfd(b"x" * 2 * PAGE), _memfd(b"y" * 2 * PAGE)]
    try:
        assert m.placeheld
        view = m.buffer(0, 4 * PAGE)
        view[0] = 7
        assert view[PAGE] == 7 and view[3 * PAGE] == 7  # one page, mapped at every page of the range
        with pytest.raises(HoldfastError, match="cannot replace a placeholder"):
            m.adopt(fds[:1], [2 * PAGE])
        assert m.placeheld and view[2 * PAGE] == 7  # refused before a page moved
        m.adopt(fds, [2 * PAGE, 2 * PAGE])
        assert not m.placeheld and bytes(view[2 * PAGE - 1:2 * PAGE + 1]) == b"xy"
        with pytest.raises(HoldfastError, match="only a placeholder"):
            m.adopt(fds, [2 * PAGE, 2 * PAGE])
    finally:
        m.unmap()
        for fd in fds:
            os.close(fd)


def test_sleep_keeps_the_addresses_and_wake_maps_new_chunks_there():
    fd = _memfd(b"w" * PAGE)
    m = HostMapping([fd], [PAGE])
    base = m.base
    try:
        m.release_pages()
        fresh = _memfd(b"n" * PAGE)
        m.map_pages([fresh], [PAGE])
        os.close(fresh)
        assert m.base == base and bytes(m.buffer(0, 1)) == b"n"
    finally:
        m.unmap()
        os.close(fd)
