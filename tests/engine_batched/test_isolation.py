"""An isolated takeover (engines/batched/isolation.py, drain.py, journal.py invariant 6) on CPU tensors: what a dead
engine's queue may still write is read from its drain mark's stamps; the successor's plan keeps every committed
sequence it can, moves rows out of pending slots, copies pending tail blocks, drops a sequence whose full blocks were
given away, and its journal of the next generation hides the dead engine's late rows from any later reader."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.batched import isolation
from engines.batched.block_manager import AdoptionError, BlockManager
from engines.batched.drain import HEADER, HELD, SLOT0, PageLayout, Pending, pending
from engines.batched.journal import Entry, Journal, JournalLayout
from engines.batched.sequence import Sequence
from tests.engine_batched.test_journal import admission

LAYOUT = JournalLayout(block_size=4, num_blocks=32, slots=6, max_len=32)
PAGES = PageLayout(LAYOUT.slots, LAYOUT.num_blocks)


class StampingMark:
    """The drain mark's stamping over a plain CPU page (drain.DrainMark registers the page with CUDA)."""

    def __init__(self, page: torch.Tensor, gen: int) -> None:
        self.bank = PAGES.bank(page, gen).numpy()
        self.n = 0

    def open(self) -> None:
        self.n += 1
        self.bank[0] = self.n

    def close(self) -> None:
        self.bank[1] = self.n  # the CPU: what is queued has run

    def touch_slots(self, slots: object) -> None:
        self.bank[SLOT0 + np.fromiter(slots, dtype=np.int64)] = self.n  # type: ignore[call-overload]

    def touch_blocks(self, blocks: object) -> None:
        self.bank[SLOT0 + PAGES.slots + np.fromiter(blocks, dtype=np.int64)] = self.n  # type: ignore[call-overload]

    def touch_header(self) -> None:
        self.bank[HEADER] = self.n

    def hold(self, slots: object, blocks: object) -> None:
        self.bank[SLOT0 + np.fromiter(slots, dtype=np.int64)] = HELD  # type: ignore[call-overload]
        self.bank[SLOT0 + PAGES.slots + np.fromiter(blocks, dtype=np.int64)] = HELD  # type: ignore[call-overload]


def tensors() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(shape, dtype=dt) for n, (dt, shape) in LAYOUT.tensors().items()}


def entry(slot: int, table: list[int], computed: int, length: int) -> Entry:
    return Entry(slot=slot, seq_id=slot, request_id=f"r{slot}", tokens=list(range(1, length + 1)), prompt_len=2,
                 computed=computed, block_table=table, max_tokens=64, temperature=0.0, seed=0, ignore_eos=False)


def test_the_plan_copies_pending_tails_moves_pending_rows_and_drops_given_away_blocks() -> None:
    entries = [entry(0, [1, 2], 6, 7),   # tail block 2 pending: copied (positions 4, 5 kept)
               entry(1, [3, 4], 4, 5),   # computed at the boundary: block 4 pending and past it, replaced
               entry(2, [5, 6], 5, 6),   # block 5 (full) pending: given to another sequence, dropped
               entry(3, [7], 2, 3)]      # its slot pending: moved
    pend = Pending(False, False, frozenset({3}), frozenset({2, 4, 5, 9}))
    p = isolation.plan(entries, pend, free_slots=[4, 5], num_blocks=12, block_size=4)
    by = {e.request_id: e for e in p.entries}
    assert set(by) == {"r0", "r1", "r3"} and [e.request_id for e in p.dropped] == ["r2"]
    assert by["r0"].slot == 0 and by["r0"].block_table[0] == 1 and by["r0"].block_table[1] not in pend.blocks
    assert p.copies == [(2, by["r0"].block_table[1])]
    assert by["r1"].block_table[0] == 3 and by["r1"].block_table[1] not in pend.blocks | {2}
    assert by["r3"].slot == 4 and by["r3"].block_table == [7] and p.moved == 1
    new = [b for e in p.entries for b in e.block_table]
    assert len(new) == len(set(new)) and not set(new) & pend.blocks
    assert (p.hold_slots, p.hold_blocks) == (pend.slots, pend.blocks)


def test_with_no_free_slot_or_block_left_a_sequence_is_dropped_not_written_over() -> None:
    pend = Pending(False, False, frozenset({0, 1}), frozenset())
    p = isolation.plan([entry(0, [1], 2, 3), entry(1, [2], 2, 3)], pend, free_slots=[2], num_blocks=3,
                       block_size=4)
    assert [e.slot for e in p.entries] == [2] and len(p.dropped) == 1
    pend = Pending(False, False, frozenset(), frozenset({1, 2}))
    p = isolation.plan([entry(0, [1], 2, 3), entry(1, [2], 2, 3)], pend, free_slots=[], num_blocks=3, block_size=4)
    assert [e.block_table for e in p.entries] == [[0]] and p.copies == [(1, 0)] and len(p.dropped) == 1


def test_the_dead_engines_late_rows_are_ignored_after_the_next_generation() -> None:
    page = torch.zeros(PAGES.numel, dtype=torch.int64)
    mem = tensors()
    dead = Journal(LAYOUT, mem)
    dead.mark = StampingMark(page, 0)
    dead.mark.open()
    dead.format()
    a = dead.admit(admission(1, [256, 5, 6]), [1])
    b = dead.admit(admission(2, [256, 7, 8]), [2])
    assert a is not None and b is not None
    dead.commit([(a, 4, 3, 40), (b, 4, 3, 41)])
    dead.mark.close()
    dead.mark.open()  # a phase cut off by the kill: row b committed again, block 2 written (not run yet)
    dead.mark.touch_blocks([2])
    dead.mark.touch_slots([b])
    pend = pending(page, PAGES, 0)
    assert not pend.drained and not pend.header and pend.slots == {b} and pend.blocks == {2}

    succ = Journal(LAYOUT, mem)
    succ.mark = StampingMark(page, 1)
    succ.mark.open()
    entries, dropped = succ.recover(pend.slots)
    assert dropped == 0 and {e.request_id for e in entries} == {"req-1", "req-2"}
    kv = torch.arange(LAYOUT.num_blocks, dtype=torch.float32).view(1, 1, -1, 1, 1, 1).repeat(2, 2, 1, 4, 1, 1)
    p = isolation.plan(entries, pend, free_slots=succ.free_slot_ids(), num_blocks=LAYOUT.num_blocks,
                       block_size=LAYOUT.block_size)
    isolation.apply(p, kv, succ, succ.gen + 1, succ.mark)
    succ.mark.close()
    mine = pending(page, PAGES, 1)  # what it holds back stays pending in its own bank, should it die too
    assert mine.slots == {b} and mine.blocks == {2} and not mine.header
    moved = next(e for e in p.entries if e.request_id == "req-2")
    assert moved.slot not in (a, b) and moved.block_table != [2] and p.copies == [(2, moved.block_table[0])]
    assert torch.equal(kv[:, :, moved.block_table[0]], kv[:, :, 1] * 0 + 2)  # block 2's content, copied
    # the dead engine's queue runs on: its late write to row b is in a generation nobody reads
    dead.commit([(b, 5, 4, 99)])
    later, _ = Journal(LAYOUT, mem).recover()
    assert sorted((e.request_id, e.slot, e.tokens[-1]) for e in later) == [("req-1", a, 40), ("req-2", moved.slot, 41)]
    # the successor's own rows go on; the held-back slot comes back empty once the dead engine is gone
    succ.commit([(moved.slot, 5, 4, 50)])
    succ.give_back(sorted(p.hold_slots))
    assert b in succ.free_slot_ids()
    final, _ = Journal(LAYOUT, mem).recover()
    assert {e.request_id: e.tokens[-1] for e in final} == {"req-1": 40, "req-2": 50}


def test_a_pending_header_or_a_drained_queue_is_told_apart() -> None:
    page = torch.zeros(PAGES.numel, dtype=torch.int64)
    m = StampingMark(page, 3)
    m.open()
    m.touch_header()
    assert pending(page, PAGES, 3).header and pending(page, PAGES, 1).header  # a bank a generation: 3 and 1 share
    m.close()
    assert pending(page, PAGES, 3).drained and not pending(page, PAGES, 0).header


def test_blocks_held_back_are_out_of_the_pool_until_given_back() -> None:
    bm = BlockManager(8, 4, prefix_caching=False)
    seq = Sequence(seq_id=1, request_id="r", tokens=[1, 2, 3, 4, 5], prompt_len=2)
    seq.num_computed, seq.block_table = 4, [0, 1]
    bm.adopt([seq], hold=[5, 6])
    assert bm.num_free_blocks == 4
    assert bm.give_back() == [5, 6] and bm.num_free_blocks == 6
    other = BlockManager(8, 4, prefix_caching=False)
    with pytest.raises(AdoptionError):
        other.adopt([dataclasses.replace(seq)], hold=[1])


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_a_later_reader_adopts_exactly_what_the_plan_kept_however_the_rows_moved(data: st.DataObject) -> None:
    """`rehome` writes again only what changed (moved rows whole; rows kept in place: fields and the block-table
    entries the plan replaced): a later reader still finds every kept sequence as the plan placed it."""
    mem = tensors()
    dead = Journal(LAYOUT, mem)
    dead.format()
    blocks = iter(range(LAYOUT.num_blocks))
    for seq in range(data.draw(st.integers(1, LAYOUT.slots))):
        length = data.draw(st.integers(2, 3 * LAYOUT.block_size))
        computed = data.draw(st.integers(1, length - 1))
        table = [next(blocks) for _ in range(-(-length // LAYOUT.block_size))]
        prompt = data.draw(st.lists(st.integers(0, 50_000), min_size=length - 1, max_size=length - 1))
        slot = dead.admit(admission(seq, prompt, prompt_len=data.draw(st.integers(1, length - 1))), table)
        assert slot is not None
        dead.commit([(slot, length, computed, data.draw(st.integers(0, 50_000)))])
    entries, _ = Journal(LAYOUT, mem).recover()
    used = {b for e in entries for b in e.block_table}
    pend = Pending(False, False, frozenset(data.draw(st.sets(st.sampled_from([e.slot for e in entries])))),
                   frozenset(data.draw(st.sets(st.sampled_from(sorted(used))))))
    succ = Journal(LAYOUT, mem)
    read, _ = succ.recover(pend.slots)
    p = isolation.plan(read, pend, free_slots=succ.free_slot_ids(), num_blocks=LAYOUT.num_blocks,
                       block_size=LAYOUT.block_size)
    kv = torch.zeros(1, 2, LAYOUT.num_blocks, LAYOUT.block_size, 1, 1)
    isolation.apply(p, kv, succ, succ.gen + 1, StampingMark(torch.zeros(PAGES.numel, dtype=torch.int64), 1))
    later, dropped = Journal(LAYOUT, mem).recover()
    key = lambda e: (e.slot, e.request_id, e.tokens, e.prompt_len, e.computed, e.block_table)  # noqa: E731
    assert dropped == 0 and sorted(map(key, later)) == sorted(map(key, p.entries))
