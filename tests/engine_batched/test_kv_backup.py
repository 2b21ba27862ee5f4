"""The KV backup to host (engines/batched/kv_backup.py, backup.py, copier.py) on CPU tensors: which blocks a round
copies and what it vouches for; a round cut off after its copy, or a row cut off mid-admission, is never trusted;
a restore gives back exactly the vouched-for KV and the journal rows at their durable point."""

from __future__ import annotations

import threading
import time

import torch

from engines.batched.backup import BackedJournal, BackupWriter, backed_journal, packed, restore
from engines.batched.journal import CHECK, Admission, Journal, JournalLayout
from engines.batched.kv_backup import (
    BACKUP_NAME,
    Backed,
    RowSnap,
    block_runs,
    blocks_between,
    durable_point,
    plan_round,
    snap_rows,
)

BS = 4
LAYOUT = JournalLayout(block_size=BS, num_blocks=16, slots=4, max_len=64)
KV_SHAPE = (2, 2, LAYOUT.num_blocks, BS, 2, 8)  # layers, k|v, blocks, block_size, heads, dim


# ---------------------------------------------------------------- pure rules


def test_the_durable_point_is_every_committed_position_but_whole_chunks_inside_a_deterministic_prompt() -> None:
    assert durable_point(70, 40, 32) == 70  # past the prompt: all of it
    assert durable_point(40, 40, 32) == 40
    assert durable_point(37, 64, 32) == 32  # mid-prompt: the successor recomputes from a chunk boundary
    assert durable_point(31, 64, 32) == 0
    assert durable_point(37, 64, None) == 37  # not deterministic: any point


def test_a_round_copies_the_blocks_of_new_positions_including_the_partial_last_one() -> None:
    assert blocks_between([7, 3, 9, 2], 5, 10, BS) == [3, 9]  # positions 5..9: blocks 1 and 2 of the table
    assert blocks_between([7, 3, 9, 2], 8, 9, BS) == [9]  # one token into a block: that whole block
    assert blocks_between([7, 3], 6, 6, BS) == []
    assert block_runs([9, 3, 4, 5, 9, 11]) == [(3, 3), (9, 1), (11, 1)]


def snap(slot: int, epoch: int, *, computed: int, length: int, blocks: tuple[int, ...]) -> RowSnap:
    return RowSnap(slot, epoch, None, 4, tuple(range(length)), blocks, length, computed)


def test_a_plan_releases_rows_that_left_or_were_admitted_again_and_skips_rows_with_nothing_new() -> None:
    book = {0: Backed(epoch=1, bslot=2, length=9, copied=8, durable=8, n_blocks=3),
            1: Backed(epoch=2, bslot=0, length=5, copied=4, durable=4, n_blocks=2),
            2: Backed(epoch=3, bslot=1, length=6, copied=5, durable=5, n_blocks=2)}
    rows = [snap(0, 1, computed=8, length=9, blocks=(4, 5, 6)),  # nothing new since its round
            snap(1, 7, computed=3, length=5, blocks=(10,)),  # slot 1 holds another sequence now
            snap(3, 8, computed=6, length=7, blocks=(12, 13))]  # new; slot 2 left
    plan = plan_round(rows, book, BS)
    assert set(plan.releases) == {1, 2}
    assert [r.slot for r in plan.rows] == [1, 3]
    assert plan.blocks == (10, 12, 13)


# ---------------------------------------------------------------- the writer and a restore, on CPU tensors


def journal_tensors() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(shape, dtype=dt) for n, (dt, shape) in LAYOUT.tensors().items()}


def backup_tensors() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(shape, dtype=dt) for n, dt, shape, _ in packed(KV_SHAPE, torch.float32, LAYOUT)}


class Engine:
    """The journal calls the step pipeline makes, with the KV each step writes (position p of a sequence gets the
    value 1000 * seq + p), and the backup writer beside them."""

    def __init__(self, chunk: int | None = None) -> None:
        self.kv = torch.zeros(KV_SHAPE)
        self.backup = backup_tensors()
        self.writer = BackupWriter(self.kv, self.backup, LAYOUT, lag_ms=100, chunk=chunk, thread=False)
        self.writer.fresh()
        self.journal: BackedJournal = backed_journal(self.writer, LAYOUT, journal_tensors())
        self.journal.format()
        self.seqs: dict[int, tuple[int, list[int], list[int], int]] = {}  # seq -> slot, tokens, blocks, computed

    def admit(self, seq: int, prompt_len: int, blocks: list[int]) -> None:
        tokens = [256] + [seq] * (prompt_len - 1)
        slot = self.journal.admit(Admission(seq, f"req-{seq}", tokens, prompt_len, 64, 0.0, 0, True), blocks)
        assert slot is not None
        self.seqs[seq] = (slot, tokens, blocks, 0)

    def run(self, seq: int, n: int, *, sample: bool) -> None:
        slot, tokens, blocks, computed = self.seqs[seq]
        for p in range(computed, computed + n):
            self.kv[:, :, blocks[p // BS], p % BS] = 1000 * seq + p
        computed += n
        tok = None
        if sample:
            tok = 7 * seq + len(tokens)
            tokens.append(tok)
        self.seqs[seq] = (slot, tokens, blocks, computed)
        self.journal.commit([(slot, len(tokens), computed, tok)])

    def restored(self) -> tuple[dict, dict, torch.Tensor, Journal]:
        """A successor's restore into a new cache from this backup (the writer's thread never ran: rounds are
        called by the test)."""
        kv = torch.zeros(KV_SHAPE)
        journal = Journal(LAYOUT, journal_tensors())
        info, book = restore(self.backup, kv, journal, LAYOUT)
        return info, book, kv, journal


def vouched_kv_equal(kv: torch.Tensor, original: torch.Tensor, blocks: list[int], upto: int) -> bool:
    for p in range(upto):
        if not torch.equal(kv[:, :, blocks[p // BS], p % BS], original[:, :, blocks[p // BS], p % BS]):
            return False
    return True


def test_a_restore_gives_back_each_sequence_at_its_durable_point_with_its_kv() -> None:
    e = Engine()
    e.admit(1, 6, [3, 4])
    e.admit(2, 3, [9])
    e.run(1, 6, sample=True)  # prefill, first token
    e.run(2, 3, sample=True)
    e.run(1, 1, sample=True)  # decode: position 6
    assert e.writer.round()
    assert not e.writer.round()  # nothing committed since
    info, book, kv, journal = e.restored()
    entries = {x.request_id: x for x in journal.recover()[0]}
    assert info["restored"] == 2 and info["dropped"] == 0 and info["recomputed_tokens"] == 0
    assert entries["req-1"].computed == 7 and entries["req-1"].tokens == e.seqs[1][1]
    assert entries["req-2"].computed == 3 and entries["req-2"].block_table == [9]
    assert vouched_kv_equal(kv, e.kv, [3, 4], 7) and vouched_kv_equal(kv, e.kv, [9], 3)
    assert {b.bslot for b in book.values()} == {0, 1}


def test_a_round_cut_off_after_its_copy_leaves_the_previous_round_vouched_for() -> None:
    e = Engine()
    e.admit(1, 5, [2, 3, 5])
    e.run(1, 5, sample=True)
    e.writer.round()
    for _ in range(4):  # decode past the round: positions 5..8, a new block's first position included
        e.run(1, 1, sample=True)
    # the next round's first two steps (releases, the copy), then the engine dies: no row written
    j = e.journal
    plan = plan_round(snap_rows(j.mirror, e.writer.book), e.writer.book, BS)
    assert plan.blocks == (3, 5)
    e.writer.copier.copy(plan.blocks, None)
    info, _, kv, journal = e.restored()
    (entry,), _ = journal.recover()
    assert entry.computed == 5 and len(entry.tokens) == 6  # the first round's, not a mix
    assert vouched_kv_equal(kv, e.kv, [2, 3, 5], 5)
    assert info["recomputed_tokens"] == 0  # its last token's logits are what decode needs next: nothing to redo


def test_a_backup_row_cut_off_mid_admission_is_dropped_and_its_blocks_not_restored() -> None:
    e = Engine()
    e.admit(1, 4, [1])
    e.run(1, 4, sample=True)
    e.writer.round()
    e.writer.bj.rows[e.writer.book[0].bslot, CHECK] = 0  # as if the engine died before the admission's check
    info, _, kv, journal = e.restored()
    assert info["restored"] == 0 and info["dropped"] == 1 and journal.recover() == ([], 0)
    assert kv.abs().sum() == 0


def test_a_sequence_released_while_its_round_copied_is_left_out_of_that_round() -> None:
    e = Engine()
    e.admit(1, 4, [1])
    e.run(1, 4, sample=True)
    copy = e.writer.copier.copy

    def copy_while_released(blocks, after):  # the step thread frees the row (and may reuse its block) meanwhile
        copy(blocks, after)
        e.journal.release(e.seqs[1][0])

    e.writer.copier.copy = copy_while_released  # type: ignore[method-assign]
    e.writer.round()
    assert e.writer.stats["left_out_released"] == 1 and e.writer.book == {}
    assert e.restored()[0]["restored"] == 0


def test_a_deterministic_prompt_cut_mid_chunk_is_restored_from_the_chunk_boundary_and_counted() -> None:
    e = Engine(chunk=8)
    e.admit(1, 12, [1, 2, 3])
    e.run(1, 8, sample=False)  # one whole chunk
    e.run(1, 2, sample=False)  # a non-deterministic engine's partial chunk: the backup vouches for the 8 only
    e.writer.round()
    info, _, _, journal = e.restored()
    (entry,), _ = journal.recover()
    assert entry.computed == 8 and info["recomputed_tokens"] == 12 - 1 - 8


def test_the_backup_rows_follow_a_sequence_that_left_and_a_slot_reused() -> None:
    e = Engine()
    e.admit(1, 4, [1])
    e.run(1, 4, sample=True)
    e.writer.round()
    e.journal.release(e.seqs.pop(1)[0])
    e.admit(2, 4, [1])  # the same slot and block, another sequence
    e.run(2, 4, sample=True)
    e.writer.round()
    info, _, kv, journal = e.restored()
    (entry,), _ = journal.recover()
    assert entry.request_id == "req-2" and info["restored"] == 1
    assert vouched_kv_equal(kv, e.kv, [1], 4) and float(kv[0, 0, 1, 0, 0, 0]) == 2000.0
    assert BACKUP_NAME in e.backup


def test_a_claims_tokens_past_the_journal_are_backed_up_with_their_row() -> None:
    """A claim's tokens past the journal go into the row (journal.write_tokens) and into its mirror: the row stays
    whole, so the backup keeps it (it skipped such rows while the main journal did not write them)."""
    e = Engine()
    e.admit(1, 4, [2, 3])
    e.run(1, 4, sample=True)  # prefill, first token: 5 tokens
    slot, tokens, blocks, computed = e.seqs[1]
    extra = [41, 42]
    e.journal.write_tokens(slot, len(tokens), extra)  # the claim (claims.py), before the next step
    tokens += extra
    e.seqs[1] = (slot, tokens, blocks, computed)
    e.run(1, 3, sample=True)  # the extra tokens fed, one more sampled
    assert not e.journal.mirror[slot].gap
    assert e.writer.round()
    _, _, _, journal = e.restored()
    (entry,), _ = journal.recover()
    assert entry.tokens == tokens and entry.computed == 7


def test_a_writer_stuck_in_a_round_or_gone_is_said_once_per_stall() -> None:
    """`stalled` (what the engine's main loop logs, with every thread's stack): a round running past its bound, or
    the writer's thread ended without an error; each once; nothing while rounds keep up or before any commit."""
    e = Engine()
    w = e.writer
    assert w.stalled(time.time()) is None  # never started: nothing was committed yet
    stuck = threading.Event()
    w._thread = threading.Thread(target=stuck.wait, daemon=True)  # a writer thread standing in a round
    w._thread.start()
    now = time.time()
    assert w.stalled(now) is None  # between rounds
    w.stats["in_round_since"] = now - 1.0
    assert w.stalled(now) is None  # a round of 1 s: slow, within the bound (5 s at least)
    w.stats["in_round_since"] = now - 6.0
    said = w.stalled(now)
    assert said is not None and "has run 6.0 s" in said and w.stats["stalls"] == 1
    assert w.stalled(now + 1) is None  # said once for this round
    w.stats["in_round_since"] = now - 0.1  # it ended; the next one runs
    assert w.stalled(now) is None
    stuck.set()
    w._thread.join(5)
    said = w.stalled(now)
    assert said is not None and "ended without an error" in said and w.stats["stalls"] == 2
    assert w.stalled(now) is None
    w.stats["error"] = "RuntimeError('copy failed')"  # a failed writer says so in its health: not a stall
    w._said = None
    assert w.stalled(now) is None
