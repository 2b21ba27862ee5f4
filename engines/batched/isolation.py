"""Isolation: a successor adopts a dead engine's journal while the dead engine's queued GPU work may still run, and
writes nothing that work writes, so that it need not wait for the dead process's exit (its CUDA teardown: 90-135 ms
after a SIGKILL under load on an H200, 2026-12-02).

What the dead engine may still write is known exactly once its threads are exiting: the journal slots and KV blocks
its drain mark stamps pending (drain.py `Pending`). `plan` (pure) decides, from the journal's committed entries
(journal.py `recover`, which leaves pending slots untouched), what the successor adopts and where; `apply` queues
the block copies and writes the journal of the next generation.

Rules (journal.py invariants 2, 3 and 6; block_manager.py invariant 4):
1. A dead engine's queued work writes only positions at or past the `computed` its committed progress vouches for,
   so a row's blocks wholly below `computed` are written again only if they were given to another sequence after
   the state the journal vouches for (the row finished or was preempted in the dead engine, its blocks reused):
   an entry with such a block pending is dropped (its request comes back through the router's replay).
2. An entry's pending block holding positions below `computed` (its tail) is copied to a free block; the copy's
   positions past `computed` may be torn, and the successor writes them before any read (it redoes the step from
   `computed`). A pending block past `computed` is replaced by a free one (nothing in it is vouched for).
3. An entry in a pending slot moves to a free slot; with none left it is dropped.
4. Pending slots and blocks are held back, neither written nor handed out, until the dead engine's exit
   (`Held.over`): then the slots are emptied and both go back to the pools. Meanwhile they stay pending in the
   successor's own drain mark (`DrainMark.hold`), so that its own successor, should it die first, holds them too.
5. Every kept entry is written again in the next generation, the header last (journal.py invariant 6): a later
   reader ignores the dead engine's rows, whatever its queue still writes into them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from engines.batched.block_manager import blocks_except
from engines.batched.drain import Mark, Pending
from engines.batched.journal import Entry, Journal, on_device
from libs.common import procs


@dataclass(frozen=True)
class Plan:
    entries: list[Entry]  # as the successor adopts them: slot and block table possibly new
    copies: list[tuple[int, int]]  # (pending tail block, its free copy)
    dropped: list[Entry]
    moved: int  # entries given a new slot
    hold_slots: frozenset[int]
    hold_blocks: frozenset[int]


def plan(entries: Iterable[Entry], pend: Pending, *, free_slots: Iterable[int], num_blocks: int,
         block_size: int) -> Plan:
    kept: list[Entry] = []
    dropped: list[Entry] = []
    for e in entries:
        full = e.computed // block_size  # blocks wholly below `computed` (rule 1)
        (dropped if any(b in pend.blocks for b in e.block_table[:full]) else kept).append(e)
    used = {b for e in kept for b in e.block_table}
    free_blocks = blocks_except(num_blocks, used | pend.blocks)
    slots = deque(free_slots)
    out: list[Entry] = []
    copies: list[tuple[int, int]] = []
    moved = 0
    for e in kept:
        slot = e.slot
        if slot in pend.slots:
            if not slots:
                dropped.append(e)
                continue
            slot, moved = slots.popleft(), moved + 1
        table = list(e.block_table)
        fresh: list[tuple[int, int]] = []
        for j in range(e.computed // block_size, len(table)):
            if table[j] not in pend.blocks:
                continue
            if not free_blocks:
                break
            new = free_blocks.popleft()
            if j * block_size < e.computed:  # rule 2: it holds positions the entry keeps
                fresh.append((table[j], new))
            table[j] = new
        if any(b in pend.blocks for b in table):  # the pool ran short: blocks taken above go back
            free_blocks.extendleft(b for b in table if b not in e.block_table)
            dropped.append(e)
            continue
        copies += fresh
        out.append(replace(e, slot=slot, block_table=table))
    return Plan(out, copies, dropped, moved, pend.slots, pend.blocks)


def apply(p: Plan, kv: torch.Tensor, journal: Journal, gen: int, mark: Mark) -> dict[str, float]:
    """The copies (one gather and one scatter over every layer), then the journal's rows of generation `gen` and
    its header (rule 5). Queued in stream order after nothing the dead engine writes. Returns the host time of each
    part (ms): `copies`, `rows`."""
    t0 = time.perf_counter()
    mark.hold(p.hold_slots, p.hold_blocks)
    if p.copies:
        mark.touch_blocks(d for _, d in p.copies)
        # the indices in one copy that does not wait for the device (journal.py `on_device`), not two that do
        idx = on_device(kv.device, [s for s, _ in p.copies] + [d for _, d in p.copies], torch.long)
        src, dst = idx.split(len(p.copies))
        kv.index_copy_(2, dst, kv.index_select(2, src))  # kv: [units, 2, blocks, block_size, heads, dim]
    t1 = time.perf_counter()
    journal.rehome(p.entries, gen)
    return {"copies": procs.ms_between(t0, t1), "rows": procs.ms_since(t1)}


@dataclass(frozen=True)
class Held:
    """Slots and blocks held back from a dead engine (`pid`, started at `start`) until its exit (rule 4)."""

    pid: int
    start: int | None
    slots: frozenset[int]

    def over(self) -> bool:
        """Whether the dead engine is gone (its context torn down): polled between steps, never blocks."""
        return procs.wait_gone(self.pid, self.start, 0.0)
