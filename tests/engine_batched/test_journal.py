"""The step journal (engines/batched/journal.py) on CPU tensors: what it commits comes back; a write cut off at
any point leaves either the state before it or the state after it, never a mix that a successor would trust."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.batched.journal import MAX_ADOPTIONS, Admission, Journal, JournalLayout, JournalMismatch

LAYOUT = JournalLayout(block_size=4, num_blocks=64, slots=8, max_len=64)


def new_journal(layout: JournalLayout = LAYOUT) -> Journal:
    j = Journal(layout, {n: torch.zeros(shape, dtype=dt) for n, (dt, shape) in layout.tensors().items()})
    j.format()
    return j


def reopen(j: Journal, layout: JournalLayout = LAYOUT) -> Journal:
    """A successor's view of the same memory (a new Journal over the same tensors)."""
    return Journal(layout, {"jr_header": j.header, "jr_rows": j.rows, "jr_tokens": j.tokens, "jr_blocks": j.blocks,
                            "jr_ids": j.ids})


def admission(seq_id: int, prompt: list[int], **kw: object) -> Admission:
    base = dict(seq_id=seq_id, request_id=f"req-{seq_id}", tokens=prompt, prompt_len=len(prompt), max_tokens=32,
                temperature=0.0, seed=0, ignore_eos=False)
    base.update(kw)
    return Admission(**base)  # type: ignore[arg-type]


def test_committed_sequences_come_back_with_tokens_progress_blocks_and_sampling() -> None:
    j = new_journal()
    s1 = j.admit(admission(1, [256, 5, 6, 7, 8], temperature=0.7, seed=42, ignore_eos=True), [3])
    s2 = j.admit(admission(2, [256, 9]), [4])
    assert s1 is not None and s2 is not None
    j.grow(s1, [3, 10])
    j.commit([(s1, 6, 5, 77), (s2, 2, 1, None)])  # s1 sampled 77 after its prompt; s2 half-prefilled
    entries, dropped = reopen(j).recover()
    by_id = {e.request_id: e for e in entries}
    assert dropped == 0 and set(by_id) == {"req-1", "req-2"}
    e1 = by_id["req-1"]
    assert e1.tokens == [256, 5, 6, 7, 8, 77] and e1.computed == 5 and e1.block_table == [3, 10]
    assert (e1.temperature, e1.seed, e1.ignore_eos, e1.prompt_len) == (0.7, 42, True, 5)
    assert by_id["req-2"].computed == 1 and by_id["req-2"].tokens == [256, 9]


def test_a_released_slot_is_empty_and_reused() -> None:
    j = new_journal(JournalLayout(block_size=4, num_blocks=8, slots=1, max_len=16))
    s = j.admit(admission(1, [256, 1]), [0])
    assert j.admit(admission(2, [256, 2]), [1]) is None  # full: that sequence runs unjournaled
    j.release(s)  # type: ignore[arg-type]
    assert reopen(j, j.layout).recover() == ([], 0)
    assert j.admit(admission(3, [256, 3]), [1]) == s


def test_an_admission_cut_off_before_its_check_is_dropped() -> None:
    j = new_journal()
    s = j.admit(admission(1, [256, 1, 2]), [0])
    j.rows[s, 8] += 1  # the check no longer vouches for the row: as if the admission's last write never landed
    entries, dropped = reopen(j).recover()
    assert entries == [] and dropped == 1


def test_a_journal_of_another_layout_is_refused() -> None:
    j = new_journal()
    other = JournalLayout(block_size=8, num_blocks=64, slots=8, max_len=64)
    try:
        Journal(other, {n: getattr(j, a) for n, a in (("jr_header", "header"), ("jr_rows", "rows"),
                                                      ("jr_tokens", "tokens"), ("jr_blocks", "blocks"),
                                                      ("jr_ids", "ids"))}).recover()
    except JournalMismatch:
        return
    raise AssertionError("a journal written for block_size 4 was read as block_size 8")


def test_a_token_written_without_its_progress_is_not_trusted() -> None:
    """Death between a step's token write and its progress store: the successor sees the step before."""
    j = new_journal()
    s = j.admit(admission(1, [256, 4, 5]), [0])
    j.commit([(s, 4, 3, 9)])
    j.tokens[s, 4] = 11  # the next step's token landed, its progress did not
    (e,), _ = reopen(j).recover()  # type: ignore[misc]
    assert e.tokens == [256, 4, 5, 9] and e.computed == 3


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 255)), min_size=1, max_size=30),
       cut=st.integers(0, 400))
def test_a_successor_reads_exactly_the_state_committed_when_the_writer_died(steps: list[tuple[int, int]],
                                                                           cut: int) -> None:
    """A random run of admissions, decode commits and releases; the memory is copied after each operation. A
    successor reading the copy taken at any point sees exactly the sequences live then, with their tokens and
    computed positions."""
    j = new_journal()
    snapshots: list[tuple[dict[str, torch.Tensor], dict[str, tuple[list[int], int]]]] = []
    live: dict[int, tuple[int, list[int], int]] = {}  # seq_id -> slot, tokens, computed
    next_id = 1
    for kind, tok in steps:
        if kind == 0 or not live:
            prompt = [256, tok]
            slot = j.admit(admission(next_id, prompt), list(range(LAYOUT.max_blocks)))
            if slot is not None:
                live[next_id] = (slot, prompt, 0)
            next_id += 1
        elif kind == 3:
            slot, _, _ = live.pop(next(iter(live)))
            j.release(slot)
        else:
            ups = []
            for sid, (slot, toks, _) in list(live.items()):
                if len(toks) < LAYOUT.max_len:
                    toks = [*toks, tok]
                    live[sid] = (slot, toks, len(toks) - 1)
                    ups.append((slot, len(toks), len(toks) - 1, tok))
            j.commit(ups)
        memory = {"jr_header": j.header.clone(), "jr_rows": j.rows.clone(), "jr_tokens": j.tokens.clone(),
                  "jr_blocks": j.blocks.clone(), "jr_ids": j.ids.clone()}
        snapshots.append((memory, {f"req-{sid}": (list(t), c) for sid, (_, t, c) in live.items()}))
    memory, expected = snapshots[min(cut, len(snapshots) - 1)]
    entries, dropped = Journal(LAYOUT, memory).recover()
    assert dropped == 0
    # computed is capped at length - 1 (a prompt just admitted has 0; a decoded one length - 1)
    assert {e.request_id: (e.tokens, e.computed) for e in entries} == expected


def test_a_row_adopted_twice_without_progress_is_not_adopted_a_third_time() -> None:
    """Invariant 8: a request whose step kills every engine that runs it (a TP group's rows are not emptied on a
    failed step) ends at most MAX_ADOPTIONS successors."""
    j = new_journal()
    s = j.admit(admission(1, [256, 5, 6]), [3])
    assert s is not None
    j.commit([(s, 4, 3, 70)])
    counts = []
    for _ in range(MAX_ADOPTIONS + 1):
        succ = reopen(j)
        entries, dropped = succ.recover()
        kept, spent = succ.adopt(entries)
        counts.append((len(kept), len(spent), dropped, [e.adoptions for e in entries]))
    assert counts == [(1, 0, 0, [0]), (1, 0, 0, [1]), (0, 1, 0, [2])]
    assert reopen(j).recover() == ([], 0)  # the spent row was emptied


def test_a_row_that_made_progress_after_its_adoption_counts_from_zero_again() -> None:
    j = new_journal()
    s = j.admit(admission(1, [256, 5, 6]), [3])
    assert s is not None
    j.commit([(s, 4, 3, 70)])
    succ = reopen(j)
    kept, _ = succ.adopt(succ.recover()[0])
    assert [e.adoptions for e in kept] == [1] and [e.adoptions for e in reopen(j).recover()[0]] == [1]
    succ.commit([(s, 4, 3, None)])  # no new token: still the length it was adopted at
    assert [e.adoptions for e in reopen(j).recover()[0]] == [1]
    succ.commit([(s, 5, 4, 71)])
    (e,), dropped = reopen(j).recover()
    assert e.adoptions == 0 and dropped == 0 and e.tokens[-2:] == [70, 71]
