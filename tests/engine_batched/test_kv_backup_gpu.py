"""The KV backup's CUDA copy path (engines/batched/copier.py): rounds copy blocks of a CUDA cache from a side stream
into host memory that is a memfd mapping, as a host lease is, registered with CUDA in place (cudaHostRegister);
the copy waits for the step's stream only through its event, and a restore gives the vouched-for blocks back.
The copy's bandwidth, and how long the step's stream waited for it (it should not), are printed."""

from __future__ import annotations

import mmap
import os
import time

import pytest
import torch

from engines.batched.backup import BackupWriter, backed_journal, packed, restore
from engines.batched.journal import Admission, Journal, JournalLayout
from engines.batched.kv_backup import BACKUP_NAME
from libs.client.memory import MemoryClient
from tests.gpu_manager.conftest import manager_factory  # noqa: F401 - a fixture

pytestmark = pytest.mark.gpu

BS = 16
LAYOUT = JournalLayout(block_size=BS, num_blocks=512, slots=64, max_len=1024)
KV_SHAPE = (32, 2, LAYOUT.num_blocks, BS, 8, 128)  # an 8b's layers, kv heads and head dim: 2 MiB a block in bf16


def host_lease_tensors() -> tuple[dict[str, torch.Tensor], mmap.mmap]:
    """The backup's tensors over one memfd mapping, as the SDK maps a host lease (not torch's pinned memory)."""
    items = packed(KV_SHAPE, torch.bfloat16, LAYOUT)
    _, dt, shape, off = items[-1]
    size = off + torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
    fd = os.memfd_create("kv-backup-test")
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    os.close(fd)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    out = {}
    for name, dt, shape, off in items:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        out[name] = whole[off:off + n].view(dt).view(shape)
    return out, m


def new_journal_tensors() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s, dtype=d, device="cuda") for n, (d, s) in LAYOUT.tensors().items()}


def test_cuda_rounds_copy_from_a_side_stream_into_registered_memfd_pages_and_restore_them() -> None:
    kv = torch.randn(KV_SHAPE, device="cuda", dtype=torch.bfloat16)
    tensors, _keep = host_lease_tensors()
    assert not tensors[BACKUP_NAME].is_pinned()
    writer = BackupWriter(kv, tensors, LAYOUT, lag_ms=100, chunk=None, thread=False)
    writer.fresh()
    journal = backed_journal(writer, LAYOUT, new_journal_tensors())
    journal.format()
    assert writer.copier.registered and tensors[BACKUP_NAME].is_pinned()  # page-locked in place: a DMA target
    seqs = 64
    for i in range(seqs):  # 64 sequences, 8 blocks each; 100 positions committed: blocks 0..6, the 7th partial
        slot = journal.admit(Admission(i, f"req-{i}", [256] + [i % 250] * 99, 100, 512, 0.0, 0, True),
                             list(range(i * 8, i * 8 + 8)))
        journal.commit([(slot, 101, 100, 7)])
    torch.cuda.synchronize()
    writer.round()
    first_ms, first_bytes = writer.stats["round_ms_last"], writer.stats["bytes_copied"]
    assert writer.stats["rows"] == seqs and writer.stats["blocks_copied"] == 7 * seqs
    src = kv.permute(2, 0, 1, 3, 4, 5).cpu()
    assert all(torch.equal(tensors[BACKUP_NAME][b], src[b]) for b in range(LAYOUT.num_blocks) if b % 8 < 7)
    for i in range(seqs):  # one decode token each, into its partial last block: a round of 64 blocks
        journal.commit([(i, 102, 101, 9)])
    writer.round()
    decode_ms = writer.stats["round_ms_last"]
    assert writer.stats["blocks_copied"] == 8 * seqs

    info, book = restore(tensors, (new_kv := torch.zeros_like(kv)), Journal(LAYOUT, new_journal_tensors()), LAYOUT)
    assert info["restored"] == seqs and info["recomputed_tokens"] == 0
    assert {b.durable for b in book.values()} == {101}
    assert torch.equal(new_kv.permute(2, 0, 1, 3, 4, 5)[[b for b in range(LAYOUT.num_blocks) if b % 8 < 7]],
                       kv.permute(2, 0, 1, 3, 4, 5)[[b for b in range(LAYOUT.num_blocks) if b % 8 < 7]])
    print(f"\nkv backup on CUDA: a round of {7 * seqs} blocks ({first_bytes / 2**20:.0f} MiB) in {first_ms} ms "
          f"({first_bytes / 2**30 / (first_ms / 1000):.1f} GiB/s), a decode round of {seqs} blocks in {decode_ms} ms; "
          f"restore of {info['bytes'] / 2**20:.0f} MiB in {info['ms']} ms")
    writer.stop()  # unregisters the pages before the mapping goes
    assert not tensors[BACKUP_NAME].is_pinned()


def test_the_copy_stream_does_not_wait_for_the_steps_stream() -> None:
    """The side stream is not serialized behind the step's (legacy default) stream: a copy issued while the step's
    stream has ~0.5 s of queued work ends long before that work does."""
    kv = torch.randn(KV_SHAPE, device="cuda", dtype=torch.bfloat16)
    tensors, _keep = host_lease_tensors()
    writer = BackupWriter(kv, tensors, LAYOUT, lag_ms=100, chunk=None, thread=False)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    busy_ms = (time.perf_counter() - t0) * 1000 * 10  # ten times this queued below
    for _ in range(200):
        a @ a
    t1 = time.perf_counter()
    writer.copier.copy(list(range(0, 64)), None)  # no event: only the copy's own stream
    copy_ms = (time.perf_counter() - t1) * 1000
    torch.cuda.synchronize()
    print(f"\n64 blocks copied in {copy_ms:.1f} ms while the step's stream had {busy_ms:.0f} ms of work queued")
    writer.stop()
    assert copy_ms < busy_ms / 4


def test_a_cuda_managers_host_lease_is_host_memory_the_backup_copies_into(manager_factory) -> None:  # noqa: ANN001, F811
    """The cuda backend leases the backup as a memfd (`host=True`), mapped here as host memory; the cache's lease is
    device memory; a round copies from one into the other."""
    manager = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="64").start()
    with MemoryClient.connect("bk", socket_path=manager.socket) as client:
        items = packed(KV_SHAPE, torch.bfloat16, LAYOUT)
        _, dt, shape, off = items[-1]
        backup = client.allocate(off + torch.Size(shape).numel(), tag="other", name=BACKUP_NAME, host=True)
        cache = client.allocate(torch.Size(KV_SHAPE).numel() * 2, tag="kv_cache", name="kv_cache")
        assert backup.info.host and not cache.info.host
        tensors = {n: backup.torch(dt, shape, off) for n, dt, shape, off in items}
        kv = cache.torch(torch.bfloat16, KV_SHAPE)
        assert tensors[BACKUP_NAME].device.type == "cpu" and kv.device.type == "cuda"
        kv.normal_()
        writer = BackupWriter(kv, tensors, LAYOUT, lag_ms=100, chunk=None, thread=False)
        writer.fresh()
        journal = backed_journal(writer, LAYOUT, new_journal_tensors())
        journal.format()
        slot = journal.admit(Admission(1, "req-1", [256] * 40, 40, 64, 0.0, 0, True), [5, 9, 11])
        journal.commit([(slot, 41, 40, 3)])
        writer.round()
        assert writer.copier.registered
        src = kv.permute(2, 0, 1, 3, 4, 5)
        assert all(torch.equal(tensors[BACKUP_NAME][b], src[b].cpu()) for b in (5, 9, 11))
        writer.stop()
