"""The drain mark: what a dead engine's queued GPU work may still write, so that its successor need not wait.

Why: a SIGKILLed engine runs no code of its own within ~1 ms, but on CUDA its pidfd says dead only after its
context's teardown (the kernel closes its files), and the GPU work it had queued keeps running ~10-25 ms after the
kill (scripts/probe_death_time.py). A fenced successor (docs/engine-batched.md) therefore read the journal only
after that exit: on an H200 under 64 streams the exit came 90-135 ms after the kill, and the successor, its leases
already mapped (a shadowing standby), waited most of it (2026-12-02).

How: a host-memory lease of the engine (a memfd held by the gpu_manager like every lease, so it is frozen and
handed on with the KV cache; registered with CUDA as a DMA target), two banks of int64, one per engine generation
(journal.py: a successor that did not wait for the exit writes the other bank). A bank holds:
  `launched`, `done`: the step thread brackets each phase of its loop that queues GPU work (a step's launch, its
             resolve's journal writes, intake, a capture: pipeline.py, engine.py). `open()`: launched += 1,
             stored by the CPU before the phase queues any GPU work; `close()`: right after the phase's last queued
             work, a stream-ordered write of `launched` into `done` (a device fill and a copy into the page).
  stamps:    one per journal slot, per KV block and for the journal's header: the number of the latest phase that
             queued a write into it, stored by the CPU before that write is queued (`touch_*`).
A bracket is as short as the queuing itself: the step thread blocks on the GPU (a launched step's tokens) and does
its host work (streaming tokens) outside any, where a kill most often finds it.
Invariants:
1. It is used only where the step thread queues every GPU write to the leases, on one stream: a single engine (not
   a TP group: other processes) without the KV backup (its copies run on a side stream of another thread). A wake's
   journal format runs on the ask's thread while the step thread is parked inside an open bracket (sleep.py), so it
   is covered too. The lease exists only then: its presence is the predecessor's promise.
2. Every GPU operation the engine queued is covered: queued after the CPU stored the `launched` of its phase and
   the stamps of what it writes (program order), and `done = n` is written only after everything queued before it
   on the stream ran.
3. Once every thread of the engine is exiting (`procs.exiting`), no counter or stamp changes and nothing more can
   be queued. From then on `done == launched` proves that every queued operation has run (`drained`): nothing of
   the dead engine writes the leases any more. Otherwise everything stamped `<= done` was written for the last
   time: what the dead engine may still write is exactly what is stamped `> done` (`Pending`). A successor that
   reads the journal and writes only elsewhere (isolation.py) need not wait for the exit; where the header is
   pending (a start-up or a wake cut off) it waits, as before (`await_fence`).
4. A successor zeroes its own bank before its first write (`DrainMark`), and opens a bracket at once with the header
   stamped (its start-up's journal writes), closed by its step thread's first act.
On the CPU nothing runs after the threads: `exiting` alone ends the fence there (no page).
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from libs.common import procs

DRAIN_NAME = "drain_mark"  # the lease's one tensor: int64[2 * PageLayout.bank_len], two banks
LAUNCHED, DONE, HEADER, SLOT0 = 0, 1, 2, 3  # a bank: launched, done, the header's stamp, the slots', the blocks'
POLL_S = 0.0005
HELD = np.iinfo(np.int64).max  # a stamp `done` never reaches: held back from a predecessor (`DrainMark.hold`)


@dataclass(frozen=True)
class PageLayout:
    """Where a bank's counters and stamps lie, for a journal of `slots` and a cache of `num_blocks`."""

    slots: int
    num_blocks: int

    @property
    def bank_len(self) -> int:
        return SLOT0 + self.slots + self.num_blocks

    @property
    def numel(self) -> int:
        return 2 * self.bank_len

    @property
    def nbytes(self) -> int:
        return -(-self.numel * 8 // 4096) * 4096

    def fits(self, page: torch.Tensor | None) -> bool:
        return page is not None and page.dtype == torch.int64 and tuple(page.shape) == (self.numel,)

    def bank(self, page: torch.Tensor, gen: int) -> torch.Tensor:
        at = (gen % 2) * self.bank_len
        return page[at:at + self.bank_len]


class Mark(Protocol):
    def open(self) -> None: ...

    def close(self) -> None: ...

    def touch_slots(self, slots: Iterable[int]) -> None: ...

    def touch_blocks(self, blocks: Iterable[int]) -> None: ...

    def touch_header(self) -> None: ...

    def hold(self, slots: Iterable[int], blocks: Iterable[int]) -> None: ...


class NoMark:
    """Where no successor reads a mark (the CPU, a TP group, the KV backup on): nothing."""

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def touch_slots(self, slots: Iterable[int]) -> None:
        pass

    def touch_blocks(self, blocks: Iterable[int]) -> None:
        pass

    def touch_header(self) -> None:
        pass

    def hold(self, slots: Iterable[int], blocks: Iterable[int]) -> None:
        pass


NO_MARK = NoMark()


class DrainMark:
    """This engine's bank of the page: generation `gen`'s (journal.py)."""

    def __init__(self, page: torch.Tensor, device: torch.device, layout: PageLayout, gen: int) -> None:
        from engines.batched.copier import register_host

        if not layout.fits(page):
            raise ValueError(f"a drain page of {tuple(page.shape)} {page.dtype} is not {layout}'s")
        t0 = time.perf_counter()
        self.page, self.device, self.layout = page, device, layout
        self.bank = layout.bank(page, gen)
        self.bank.zero_()  # invariant 4
        self.stamps = self.bank.numpy()
        self.n = 0
        self.depth = 0
        t1 = time.perf_counter()
        self.registered = register_host(page)
        t2 = time.perf_counter()
        self.dev = torch.zeros(1, dtype=torch.int64, device=device)
        t3 = time.perf_counter()
        self.open()  # what start-up queues (the journal formatted or adopted): closed by the step thread's first act
        self.touch_header()
        # where opening the mark went (a successor's recovery reports it: it is on the way to its first token)
        self.opened_ms = {"zero": procs.ms_between(t0, t1), "register": procs.ms_between(t1, t2),
                          "device": procs.ms_between(t2, t3), "stamp": procs.ms_since(t3)}

    def open(self) -> None:
        """Before queuing GPU work. Brackets nest: only the outermost counts."""
        self.depth += 1
        if self.depth == 1:
            self.n += 1
            self.stamps[LAUNCHED] = self.n

    def close(self) -> None:
        """After queuing it: at the outermost, `done` follows in stream order."""
        self.depth -= 1
        if self.depth == 0:
            self.dev.fill_(self.n)
            self.bank[DONE:DONE + 1].copy_(self.dev, non_blocking=True)

    def touch_slots(self, slots: Iterable[int]) -> None:
        """Journal rows the open phase is about to write (invariant 2)."""
        self.stamps[SLOT0 + np.fromiter(slots, dtype=np.int64)] = self.n

    def touch_blocks(self, blocks: Iterable[int]) -> None:
        """KV blocks the open phase is about to write."""
        self.stamps[SLOT0 + self.layout.slots + np.fromiter(blocks, dtype=np.int64)] = self.n

    def touch_header(self) -> None:
        self.stamps[HEADER] = self.n

    def hold(self, slots: Iterable[int], blocks: Iterable[int]) -> None:
        """Slots and blocks this engine holds back from its dead predecessor (isolation.py), stamped pending until
        it gives them back (touching them then): should this engine die first, its successor holds them back too."""
        self.stamps[SLOT0 + np.fromiter(slots, dtype=np.int64)] = HELD
        self.stamps[SLOT0 + self.layout.slots + np.fromiter(blocks, dtype=np.int64)] = HELD

    def stop(self) -> None:
        """Unregister the page (a registration outliving the mapping would make a later mapping at that address look
        pinned while DMA still targets the old page)."""
        if self.registered:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self.page.data_ptr())
            self.registered = False


@dataclass(frozen=True)
class Pending:
    """What a dead engine's queue may still write (invariant 3): nothing when `drained`."""

    drained: bool
    header: bool
    slots: frozenset[int]
    blocks: frozenset[int]


def pending(page: torch.Tensor, layout: PageLayout, gen: int) -> Pending:
    """Read once every thread of the engine is exiting. `done` first: it only grows while the queue runs, so an
    early read can only leave more pending."""
    bank = layout.bank(page, gen).numpy()
    done = int(bank[DONE])
    stamps = bank.copy()
    slots = frozenset(int(s) for s in np.nonzero(stamps[SLOT0:SLOT0 + layout.slots] > done)[0])
    blocks = frozenset(int(b) for b in np.nonzero(stamps[SLOT0 + layout.slots:] > done)[0])
    # drained: its queue ran, and it held nothing back from a predecessor of its own (`DrainMark.hold`)
    return Pending(int(stamps[LAUNCHED]) == done and not slots and not blocks, int(stamps[HEADER]) > done, slots,
                   blocks)


def await_fence(pid: int, start: int | None, proven: Callable[[], str | None] | None, *, timeout_s: float) -> str:
    """Wait until the fenced predecessor `pid` can write the leases no more, or until what it may still write is
    known: once every thread of it is exiting, `proven()` (None: no page) says how ("stopped" on the CPU,
    "drained", "isolated") or None to go on waiting; else "exited" (its pidfd: the teardown over). Raises
    TimeoutError after `timeout_s`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return "exited"
    deadline = time.monotonic() + timeout_s
    try:
        if start is not None and procs.start_time(pid) != start:
            return "exited"  # the pid names another process now
        while True:
            if proven is not None and procs.exiting(pid, start):
                how = proven()
                if how is not None:
                    return how
            if select.select([fd], [], [], POLL_S)[0]:
                return "exited"
            if time.monotonic() > deadline:
                raise TimeoutError(f"predecessor pid {pid} has not exited in {timeout_s} s: its leases stay untouched")
    finally:
        os.close(fd)


def open_drain(client: Any, handed_on: torch.Tensor | None, device: torch.device, layout: PageLayout,
               gen: int) -> DrainMark:
    """This engine's mark: over the page handed on by its predecessor, else (none, or one of another layout: it is
    released) over a new host lease (registered and committed with the others)."""
    if not layout.fits(handed_on):
        for lease in [lz for lz in client.leases.values() if any(m.name == DRAIN_NAME for m in lz.tensor_metas)]:
            client.release(lease.id)
        lease = client.allocate(layout.nbytes, tag="other", name=DRAIN_NAME, host=True)
        meta = lease.meta(DRAIN_NAME, torch.int64, (layout.numel,))
        client.register([meta])
        client.commit()
        handed_on = lease.view(meta, "torch")
    assert handed_on is not None
    return DrainMark(handed_on, device, layout, gen)
