"""The KV block manager (engines/batched/block_manager.py): allocation, reference counts, prefix sharing by
chained block hash, eviction, adoption of journal block tables."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engines.batched.block_manager import (
    AdoptionError,
    BlockAccountingError,
    BlockManager,
    OutOfBlocks,
    blocks_except,
    chain_hash,
)
from engines.batched.sequence import Sequence

BS = 4


def seq(sid: int, tokens: list[int], prompt_len: int | None = None) -> Sequence:
    return Sequence(sid, f"r{sid}", tokens, len(tokens) if prompt_len is None else prompt_len)


def compute(bm: BlockManager, s: Sequence, n: int, prefix: list[int] | None = None) -> None:
    """What the scheduler does for a chunk: allocate, (the forward), advance, register."""
    bm.allocate(s, n, prefix or ())
    s.num_computed += n
    bm.register(s)


def test_allocation_covers_the_next_tokens_and_free_returns_every_block() -> None:
    bm = BlockManager(8, BS)
    s = seq(1, list(range(10)))
    bm.allocate(s, 5)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    s.num_computed = 5
    bm.allocate(s, 3)  # positions 5..7 fit in block 1
    assert len(s.block_table) == 2
    bm.allocate(s, 4)  # positions 5..8
    assert len(s.block_table) == 3 and all(bm.ref_count(b) == 1 for b in s.block_table)
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == [] and s.num_computed == 0


def test_a_short_pool_refuses_atomically() -> None:
    bm = BlockManager(2, BS)
    s = seq(1, list(range(12)))
    assert not bm.can_allocate(s, 9) and bm.max_allocatable(s) == 8
    with pytest.raises(OutOfBlocks):
        bm.allocate(s, 9)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_a_second_sequence_with_the_same_prefix_shares_its_full_computed_blocks() -> None:
    bm = BlockManager(16, BS)
    a = seq(1, list(range(11)))
    compute(bm, a, 10)  # blocks 0 and 1 full and computed, block 2 partial
    b = seq(2, list(range(10)) + [99, 98])
    hit = bm.cached_prefix(b)
    assert hit == a.block_table[:2]  # the partial third block is not shared
    compute(bm, b, 4, hit)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.ref_count(x) for x in b.block_table] == [2, 2, 1]
    assert b.num_computed == 12


def test_a_match_never_covers_the_last_token() -> None:
    bm = BlockManager(16, BS)
    a = seq(1, list(range(9)))
    compute(bm, a, 8)  # two full blocks
    same = seq(2, list(range(8)))  # exactly two blocks: the last token must still be fed
    assert len(bm.cached_prefix(same)) == 1
    longer = seq(3, list(range(9)))
    assert len(bm.cached_prefix(longer)) == 2


def test_only_computed_blocks_are_found() -> None:
    bm = BlockManager(16, BS)
    a = seq(1, list(range(12)))
    bm.allocate(a, 8)  # allocated, not computed: no hash yet
    bm.register(a)
    assert bm.cached_prefix(seq(2, list(range(12)))) == []
    a.num_computed = 8
    bm.register(a)
    assert len(bm.cached_prefix(seq(3, list(range(12))))) == 2


def test_hashes_chain_over_the_whole_prefix() -> None:
    bm = BlockManager(16, BS)
    a = seq(1, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    compute(bm, a, 8)
    other_first = seq(2, [9, 9, 9, 9, 2, 2, 2, 2, 0])  # same second block behind a different first one
    assert bm.cached_prefix(other_first) == []
    assert chain_hash(b"", [2, 2, 2, 2]) != bm.token_block_hashes(a, 2)[1]


def test_a_freed_cached_block_stays_reusable_until_evicted_least_recent_first() -> None:
    bm = BlockManager(4, BS)
    a = seq(1, list(range(9)))
    compute(bm, a, 8)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = seq(2, list(range(9)))
    assert bm.cached_prefix(b) == a_blocks  # refcount 0, still found
    # Empty blocks go first: two new blocks cost no cached one.
    c = seq(3, [50 + i for i in range(8)])
    bm.allocate(c, 8)
    assert not set(c.block_table) & set(a_blocks) and bm.num_cached_blocks == 2
    # Then the least recently freed: a's tail (freed first) is evicted before its head.
    d = seq(4, [70])
    bm.allocate(d, 1)
    assert d.block_table == [a_blocks[1]] and bm.evictions == 1
    assert bm.cached_prefix(seq(5, list(range(9)))) == a_blocks[:1]


def test_a_shared_block_is_freed_exactly_when_its_last_holder_goes() -> None:
    bm = BlockManager(8, BS)
    a = seq(1, list(range(6)))
    compute(bm, a, 5)
    b = seq(2, list(range(6)))
    compute(bm, b, 2, bm.cached_prefix(b))
    shared = a.block_table[0]
    assert b.block_table[0] == shared and bm.ref_count(shared) == 2
    free_before = bm.num_free_blocks
    bm.free(a)
    assert bm.ref_count(shared) == 1 and bm.num_free_blocks == free_before + 1  # only a's own block
    bm.free(b)
    assert bm.ref_count(shared) == 0 and bm.num_free_blocks == 8


def test_freeing_a_block_held_by_none_is_a_broken_invariant() -> None:
    bm = BlockManager(4, BS)
    s = seq(1, [1, 2, 3])
    s.block_table = [2]
    with pytest.raises(BlockAccountingError, match="block 2"):
        bm.free(s)


def test_without_prefix_caching_nothing_is_shared() -> None:
    bm = BlockManager(8, BS, prefix_caching=False)
    a = seq(1, list(range(9)))
    compute(bm, a, 8)
    assert bm.cached_prefix(seq(2, list(range(9)))) == [] and bm.num_cached_blocks == 0


def test_chunk_keyed_hashes_share_only_blocks_computed_in_the_same_chunks() -> None:
    bm = BlockManager(32, BS, chunk_keyed=8)
    a = seq(1, list(range(20)), prompt_len=12)  # chunks [0,8) [8,12), then one position per step
    compute(bm, a, 19)
    b = seq(2, list(range(20)), prompt_len=20)  # chunks [0,8) [8,16) [16,20)
    hit = bm.cached_prefix(b)
    assert hit == a.block_table[:2]  # only the first chunk was computed alike
    c = seq(3, list(range(20)), prompt_len=12)
    assert bm.cached_prefix(c) == a.block_table[:4]


def test_block_hashes_are_the_same_in_another_process() -> None:
    bm = BlockManager(8, BS)
    here = bm.token_block_hashes(seq(1, list(range(9))), 2)
    code = ("from engines.batched.block_manager import BlockManager; from engines.batched.sequence import Sequence;"
            "print(BlockManager(8, 4).token_block_hashes(Sequence(1, 'r', list(range(9)), 9), 2)[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=".")
    assert out.stdout.strip() == here[1].hex()


# -- adoption ---------------------------------------------------------------------------------------------

def live_state(bm: BlockManager) -> tuple[list[int], int, int]:
    return [bm.ref_count(b) for b in range(bm.num_blocks)], bm.num_free_blocks, bm.num_cached_blocks


def journal_copy(s: Sequence) -> Sequence:
    c = Sequence(s.seq_id, s.request_id, list(s.tokens), s.prompt_len, s.params)
    c.num_computed, c.block_table = s.num_computed, list(s.block_table)
    return c


def test_adoption_rebuilds_reference_counts_and_hashes() -> None:
    bm = BlockManager(16, BS)
    a = seq(1, list(range(11)))
    compute(bm, a, 10)
    b = seq(2, list(range(8)) + [7, 7, 7])
    compute(bm, b, 3, bm.cached_prefix(b))
    succ = BlockManager(16, BS)
    succ.adopt([journal_copy(a), journal_copy(b)])
    assert [succ.ref_count(x) for x in range(16)] == [bm.ref_count(x) for x in range(16)]
    assert succ.num_free_blocks == bm.num_free_blocks
    assert succ.cached_prefix(seq(3, list(range(12)))) == a.block_table[:2]


@pytest.mark.parametrize(("tables", "computed", "match"), [
    ([[0, 16]], [5], "outside 0..15"),
    ([[0, -1]], [5], "outside"),
    ([[3, 3]], [5], "listed twice"),
    ([[0]], [5], r"needs 2\.\.3"),  # five computed positions need two blocks
    ([[0, 1, 2, 4]], [5], r"needs 2\.\.3"),  # more blocks than its 9 tokens fill
    ([[0, 1], [1, 2]], [5, 5], "index"),  # block 1 at different indexes
    ([[0, 1], [0, 2]], [5, 3], "not a shared, computed prefix"),  # block 0 not computed in the second
    ([[0, 1], [0, 2]], [2, 5], "not a shared"),  # nor in the first
])
def test_adoption_refuses_inconsistent_tables_and_changes_nothing(tables, computed, match) -> None:
    seqs = []
    for i, (t, c) in enumerate(zip(tables, computed, strict=True)):
        s = seq(i, list(range(9)))
        s.block_table, s.num_computed = list(t), c
        seqs.append(s)
    bm = BlockManager(16, BS)
    before = live_state(bm)
    with pytest.raises(AdoptionError, match=match):
        bm.adopt(seqs)
    assert live_state(bm) == before


def test_adoption_refuses_a_block_shared_by_different_contents() -> None:
    a, b = seq(1, list(range(9))), seq(2, [5] * 9)
    for s in (a, b):
        s.block_table, s.num_computed = [0, 1], 5
    with pytest.raises(AdoptionError, match="block 0"):
        BlockManager(16, BS).adopt([a, b])


def test_adoption_needs_an_empty_manager() -> None:
    bm = BlockManager(8, BS)
    bm.allocate(seq(1, [1, 2]), 2)
    with pytest.raises(AdoptionError, match="holds no blocks"):
        bm.adopt([])


def test_adoption_keeps_the_hash_on_the_shared_block_when_a_duplicate_comes_first() -> None:
    # c computed the same first block as a and b side by side (a duplicate, unregistered); a and b share one.
    a, b, c = (seq(i, [1, 2, 3, 4, 5]) for i in (1, 2, 3))
    for s, table in ((a, [0, 1]), (b, [0, 2]), (c, [3, 4])):
        s.block_table, s.num_computed = table, 4
    bm = BlockManager(8, BS)
    bm.adopt([c, a, b])
    assert bm.pending == {1, 2, 3} and bm.block_hash(0) is None  # registered later (invariant 6)
    bm.register_pending()
    assert bm.block_hash(0) is not None and bm.block_hash(3) is None and bm.pending == set()
    assert bm.cached_prefix(seq(4, [1, 2, 3, 4, 5])) == [0]


def test_adopted_blocks_are_registered_later_in_one_pass_and_a_step_does_not_register_them_alone() -> None:
    """Invariant 6: `adopt` hashes nothing; a step's `register` leaves the adopted sequences to `register_pending`,
    which registers what they computed since too; one freed before it gives its blocks to the empty pool."""
    a, b, c = seq(1, list(range(11))), seq(2, list(range(8)) + [9, 9, 9]), seq(3, [5] * 9)
    bm = BlockManager(16, BS)
    compute(bm, a, 10)
    compute(bm, b, 3, bm.cached_prefix(b))  # a's first two blocks, shared
    compute(bm, c, 8)
    eager = {x: bm.block_hash(x) for x in range(16)}
    succ = BlockManager(16, BS)
    copies = [journal_copy(s) for s in (a, b, c)]
    succ.adopt(copies)
    assert succ.num_cached_blocks == 0
    ca = copies[0]
    ca.tokens.append(11)  # a computes two more positions: its third block fills up
    succ.allocate(ca, 2)
    ca.num_computed += 2
    succ.register(ca)
    assert succ.num_cached_blocks == 0  # a step registers no adopted sequence's blocks alone
    succ.free(copies[2])  # c finishes before the registration: its blocks are empty, not cached
    assert succ.num_free_blocks == 16 - len({*a.block_table, *b.block_table})
    succ.register_pending()
    registered = {x: succ.block_hash(x) for x in range(16) if succ.block_hash(x) is not None}
    assert b.block_table[:2] == a.block_table[:2] and eager[a.block_table[0]] is not None
    assert registered == {x: eager[x] for x in a.block_table[:2]} | {ca.block_table[2]: succ.token_block_hashes(ca, 3)[2]}
    assert succ.cached_prefix(seq(4, list(range(12)) + [0])) == ca.block_table[:3]


def test_a_prefix_lookup_registers_the_adopted_blocks_first() -> None:
    a = seq(1, list(range(11)))
    bm = BlockManager(16, BS)
    compute(bm, a, 10)
    succ = BlockManager(16, BS)
    succ.adopt([journal_copy(a)])
    assert succ.num_cached_blocks == 0
    assert succ.cached_prefix(seq(2, list(range(9)))) == a.block_table[:2] and succ.num_cached_blocks == 2


@given(st.integers(0, 300), st.lists(st.integers(-5, 320), max_size=40))
def test_blocks_except_is_every_other_block_in_order(num_blocks: int, taken: list[int]) -> None:
    """The pool `adopt` and isolation.py rebuild: every id below num_blocks that is not taken, ascending (ids out of
    range ignored)."""
    assert list(blocks_except(num_blocks, taken)) == [b for b in range(num_blocks) if b not in set(taken)]
