"""The drain mark: a dead engine's queued GPU work proven finished before its exit, so its successor need not wait.

Why: a SIGKILLed engine runs no code of its own within ~1 ms, but on CUDA its pidfd says dead only after its
context's teardown (the kernel closes its files), and the GPU work it had queued keeps running ~10-25 ms after the
kill (scripts/probe_death_time.py). A fenced successor (docs/engine-batched.md) therefore read the journal only
after that exit: on an H200 under 64 streams the exit came 110-130 ms after the kill, and the successor, its leases
already mapped (a shadowing standby), waited 74-91 ms of it (2026-12-02).

How: two int64 counters, `launched` and `done`, in a small host-memory lease of the engine (a memfd held by the
gpu_manager like every lease, so it is frozen and handed on with the KV cache; registered with CUDA as a DMA target).
The step thread brackets each phase of its loop that queues GPU work (a step's launch, its resolve's journal
writes, intake, a capture: pipeline.py, engine.py):
  `open()`:  launched += 1, stored by the CPU before the phase queues any GPU work;
  `close()`: right after the phase's last queued work, a stream-ordered write of `launched` into `done` (a device
             fill and a copy into the registered page, on the step's stream).
A bracket is as short as the queuing itself: the step thread blocks on the GPU (a launched step's tokens) and does
its host work (streaming tokens) outside any, where a kill most often finds it. (Bracketing whole passes of the
loop, the thread blocked inside one, a kill found `done < launched` in 3 of 3 trials on an H200, 2026-12-02.)
Invariants:
1. It is used only where the step thread queues every GPU write to the leases, on one stream: a single engine (not
   a TP group: other processes) without the KV backup (its copies run on a side stream of another thread). A wake's
   journal format runs on the ask's thread while the step thread is parked inside an open bracket (sleep.py), so it
   is covered too. The lease exists only then: its presence is the predecessor's promise.
2. Every GPU operation the engine queued is covered: queued after the CPU stored the `launched` of its phase
   (program order), and `done = n` is written only after everything queued before it on the stream ran.
3. Once every thread of the engine is exiting (`procs.exiting`), `launched` never changes and nothing more can be
   queued. From then on `done == launched` proves that every queued operation has run: nothing of the dead engine
   writes the leases any more, though its context is still being torn down. `done < launched` (killed mid-pass, or
   the teardown cut its queue short) proves nothing: the successor waits for the exit, as before (`await_fence`).
4. A successor resets both counters after its fence and opens a bracket at once (its start-up's journal writes),
   closed by its step thread's first act: the page is its own from then on.
On the CPU nothing runs after the threads: `exiting` alone ends the fence there (no page).
"""

from __future__ import annotations

import os
import select
import time
from typing import Any, Protocol

import torch

from libs.common import procs

DRAIN_NAME = "drain_mark"  # the lease's one tensor: int64[2] = (launched, done)
PAGE_BYTES = 4096
POLL_S = 0.0005


class Mark(Protocol):
    def open(self) -> None: ...

    def close(self) -> None: ...


class NoMark:
    """Where no successor reads a mark (the CPU, a TP group, the KV backup on): nothing."""

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_MARK = NoMark()


class DrainMark:
    def __init__(self, page: torch.Tensor, device: torch.device) -> None:
        from engines.batched.copier import register_host

        self.page, self.device = page, device
        page.zero_()  # invariant 4
        self.n = 0
        self.depth = 0
        self.registered = register_host(page)
        self.dev = torch.zeros(1, dtype=torch.int64, device=device)
        self.open()  # what start-up queued (the journal formatted or adopted): closed by the step thread's first act

    def open(self) -> None:
        """Before queuing GPU work. Brackets nest: only the outermost counts."""
        self.depth += 1
        if self.depth == 1:
            self.n += 1
            self.page[0] = self.n

    def close(self) -> None:
        """After queuing it: at the outermost, `done` follows in stream order."""
        self.depth -= 1
        if self.depth == 0:
            self.dev.fill_(self.n)
            self.page[1:2].copy_(self.dev, non_blocking=True)

    def stop(self) -> None:
        """Unregister the page (a registration outliving the mapping would make a later mapping at that address look
        pinned while DMA still targets the old page)."""
        if self.registered:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self.page.data_ptr())
            self.registered = False


def drained(page: torch.Tensor) -> bool:
    return int(page[1]) == int(page[0])


def await_fence(pid: int, start: int | None, page: torch.Tensor | None, *, cpu: bool, timeout_s: float) -> str:
    """Wait until the fenced predecessor `pid` can write the leases no more; returns how that was known: "stopped"
    (the CPU: its threads exiting), "drained" (invariant 3) or "exited" (its pidfd: the teardown over). Raises
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
            if (cpu or page is not None) and procs.exiting(pid, start):
                if cpu:
                    return "stopped"
                if page is not None and drained(page):
                    return "drained"
            if select.select([fd], [], [], POLL_S)[0]:
                return "exited"
            if time.monotonic() > deadline:
                raise TimeoutError(f"predecessor pid {pid} has not exited in {timeout_s} s: its leases stay untouched")
    finally:
        os.close(fd)


def open_drain(client: Any, handed_on: torch.Tensor | None, device: torch.device) -> DrainMark:
    """This engine's mark: over the page handed on by its predecessor, else over a new host lease (registered and
    committed with the others)."""
    if handed_on is None:
        lease = client.allocate(PAGE_BYTES, tag="other", name=DRAIN_NAME, host=True)
        meta = lease.meta(DRAIN_NAME, torch.int64, (2,))
        client.register([meta])
        client.commit()
        handed_on = lease.view(meta, "torch")
    return DrainMark(handed_on, device)
