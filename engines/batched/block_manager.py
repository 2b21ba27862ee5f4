"""Paged KV blocks: a free pool, reference counts, per-sequence block tables, prefix sharing by block hash.
Pure: no torch, no I/O. The KV tensor itself belongs to the model runner; this module only hands out ids.

A block is in exactly one of three places (four while a successor holds back blocks a dead engine may still write:
`adopt`'s `hold`, outside everything until `give_back`):
- held: reference count >= 1, listed in the block tables of that many live sequences;
- cached-free: reference count 0 but its content is registered under its hash, so a later sequence with the
  same prefix can take it back; evicted least recently freed first when a new block is needed;
- empty: reference count 0, no content worth keeping; allocated before any cached block is evicted.

Invariants (checked by tests/engine_batched/test_block_manager*.py):
1. `ref_count(b)` equals the number of live block tables that list `b`; never negative.
2. A block is listed by two tables only if it was shared through its hash: it is full, its KV computed, and
   it sits at the same index of both tables behind the same chained content.
3. A block returns to the pool exactly when its last holder frees it.
4. Only full blocks whose KV is computed are registered; a registered block is never written again (a
   sequence writes only at positions >= num_computed, which lie in its own later blocks). So shared blocks
   are immutable and copy-on-write is not needed.
5. A prefix match never covers a sequence's last token: that token must be fed to sample the next one.
6. Adopted sequences' blocks are registered once `register_pending` runs (the engine calls it once their claims'
   first tokens are out; a prefix lookup runs it first), not in `adopt`: hashing every block of 64
   adopted sequences took ~3 ms of a successor's way to its first step. Until then a block two adopted tables
   list is not registered yet (invariant 2's "through its hash" is checked in `adopt` itself), and an adopted
   sequence freed before it gives its blocks to the empty pool.

Block hash: blake2b-128 chained over the previous block's hash and this block's token ids, so equal hashes
mean equal whole prefixes (not just equal blocks) and hashes agree across processes (a successor engine
recomputes them from a journal's tokens). With `chunk_keyed=C` (deterministic mode) the hash also covers
where the prefill chunk that computed the block ended (see `_block_marker`), so a block computed with other
chunk boundaries is never shared and results do not depend on what happened to be cached.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from engines.batched.sequence import Sequence


class OutOfBlocks(RuntimeError):
    """`allocate` was asked for more blocks than are free (callers check `can_allocate` first)."""


class BlockAccountingError(RuntimeError):
    """A broken invariant: a block freed more often than it was held. Crash, do not continue."""


class AdoptionError(ValueError):
    """Block tables from a journal that cannot be adopted as they are (out of range, inconsistent)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def blocks_except(num_blocks: int, taken: Iterable[int]) -> deque[int]:
    """Every block id below `num_blocks` but `taken`, ascending: the runs between taken ids added as ranges, so that
    the cost follows the taken count, not the cache's size (a successor's adoption of 64 sequences over 32k blocks
    spent ~2.5 ms testing each id in Python; ~0.2 ms this way)."""
    out: deque[int] = deque()
    at = 0
    for b in sorted({b for b in taken if 0 <= b < num_blocks}):
        out.extend(range(at, b))
        at = b + 1
    out.extend(range(at, num_blocks))
    return out


def chain_hash(prev: bytes, token_ids: Seq[int], marker: int = 0) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(marker.to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 chunk_keyed: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if chunk_keyed is not None and (chunk_keyed < 1 or chunk_keyed % block_size):
            raise ValueError(f"chunk_keyed {chunk_keyed} must be a positive multiple of block_size {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.chunk_keyed = chunk_keyed
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._empty: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest first: the eviction order
        self._held: set[int] = set()  # out of the pool until given back (adopt's `hold`)
        self._pending: dict[int, Sequence] = {}  # adopted sequences whose blocks are not registered yet (invariant 6)
        self.evictions = 0

    # -- views -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` may hand out (empty ones and cached ones it may evict)."""
        return len(self._empty) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, held or not."""
        return len(self._by_hash)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> bytes | None:
        return self._hash_of[block]

    @property
    def pending(self) -> frozenset[int]:
        """The adopted sequences (ids) whose blocks are not registered yet (invariant 6)."""
        return frozenset(self._pending)

    # -- hashing -----------------------------------------------------------------------------------------
    def _block_marker(self, seq: Sequence, j: int) -> int:
        """0 unless chunk-keyed. Then the end of the prefill chunk that computes block j (a block lies in one
        chunk as C is a multiple of block_size): chunk ends are multiples of C capped by the prompt end, and
        positions past the prompt are computed one per step, so `min(chunk end, prompt_len)` pins how every
        position of the block was computed given the chain of tokens before it."""
        if self.chunk_keyed is None:
            return 0
        c = self.chunk_keyed
        return min((j * self.block_size // c + 1) * c, seq.prompt_len)

    def token_block_hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """seq's chained block hashes, at least its first n full token blocks' (computed once, kept on the
        sequence; the list may hold more than n)."""
        bs, hashes = self.block_size, seq.block_hashes
        assert n * bs <= len(seq.tokens), "only full token blocks have a hash"
        while len(hashes) < n:
            j = len(hashes)
            prev = hashes[-1] if hashes else b""
            hashes.append(chain_hash(prev, seq.tokens[j * bs:(j + 1) * bs], self._block_marker(seq, j)))
        return hashes

    # -- prefix sharing ----------------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Registered blocks that hold seq's leading full blocks, looked up only (nothing is taken). Never
        the whole of seq's tokens: at least the last token is left to compute (invariant 5)."""
        if not self.prefix_caching or seq.block_table or seq.num_computed:
            return []
        self.register_pending()
        n = (len(seq.tokens) - 1) // self.block_size
        found: list[int] = []
        for h in self.token_block_hashes(seq, n)[:n]:
            b = self._by_hash.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def register(self, seq: Sequence) -> None:
        """Register seq's full, computed blocks under their hashes (after its num_computed advanced). A block
        whose content another block already holds (two sequences computed the same prefix in one step) stays
        unregistered: the first one serves later matches."""
        n_full = seq.num_computed // self.block_size
        if not self.prefix_caching or n_full == 0 or self._hash_of[seq.block_table[n_full - 1]] is not None:
            return  # the usual step: no block filled up since the last call
        if self._pending and seq.seq_id in self._pending:
            return  # registered with the other adopted ones (invariant 6)
        hashes = self.token_block_hashes(seq, n_full)
        # Registered blocks form a prefix of the table bar duplicates, so scan down from the top until one.
        for j in range(n_full - 1, -1, -1):
            b = seq.block_table[j]
            if self._hash_of[b] is not None:
                break
            if hashes[j] not in self._by_hash:
                self._by_hash[hashes[j]] = b
                self._hash_of[b] = hashes[j]

    # -- allocation --------------------------------------------------------------------------------------
    def max_allocatable(self, seq: Sequence, prefix: Seq[int] = ()) -> int:
        """How many tokens past seq's computed ones (or past `prefix`, if given) blocks can be found for."""
        base = len(prefix) * self.block_size if prefix else seq.num_computed
        held = len(seq.block_table) + len(prefix)
        revived = sum(1 for b in prefix if self._ref[b] == 0) if prefix else 0  # they leave the pool
        return (held + self.num_free_blocks - revived) * self.block_size - base

    def can_allocate(self, seq: Sequence, num_tokens: int, prefix: Seq[int] = ()) -> bool:
        if prefix:
            return num_tokens <= self.max_allocatable(seq, prefix)
        # The step's common case (a decode, a chunk) without building anything.
        need = -(-(seq.num_computed + num_tokens) // self.block_size) - len(seq.block_table)
        return need <= len(self._empty) + len(self._cached_free)

    def allocate(self, seq: Sequence, num_tokens: int, prefix: Seq[int] = ()) -> None:
        """Make seq's block table cover its next `num_tokens` positions. With `prefix` (from
        `cached_prefix`, for a sequence holding no blocks) take those blocks first and mark their tokens
        computed. Atomic: raises `OutOfBlocks` and changes nothing when the pool is short."""
        if prefix:
            if seq.block_table or seq.num_computed:
                raise ValueError(f"sequence {seq.seq_id}: a prefix is taken only by a sequence with no blocks")
            want = self.token_block_hashes(seq, len(prefix))[:len(prefix)]
            if any(self._hash_of[b] != h for b, h in zip(prefix, want, strict=True)):
                raise ValueError(f"sequence {seq.seq_id}: prefix blocks do not hold its tokens (stale lookup?)")
        if not self.can_allocate(seq, num_tokens, prefix):
            raise OutOfBlocks(f"sequence {seq.seq_id}: {num_tokens} tokens need more than "
                              f"{self.num_free_blocks} free blocks")
        for b in prefix:
            if self._ref[b] == 0:
                del self._cached_free[b]
            self._ref[b] += 1
        seq.block_table.extend(prefix)
        if prefix:
            seq.num_computed = len(prefix) * self.block_size
        need = _ceil_div(seq.num_computed + num_tokens, self.block_size) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take_block())

    def _take_block(self) -> int:
        if self._empty:
            b = self._empty.popleft()
        else:
            b, _ = self._cached_free.popitem(last=False)  # evict the least recently freed
            h = self._hash_of[b]
            assert h is not None
            del self._by_hash[h]
            self._hash_of[b] = None
            self.evictions += 1
        self._ref[b] = 1
        return b

    def free(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks; its KV is gone for it (num_computed = 0). Blocks are released
        last first, so that a sequence's tail (least likely shared) is the first evicted."""
        for b in reversed(seq.block_table):
            if self._ref[b] <= 0:
                raise BlockAccountingError(f"block {b} freed by sequence {seq.seq_id} while held by none")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash_of[b] is not None:
                    self._cached_free[b] = None
                else:
                    self._empty.append(b)
        seq.block_table.clear()
        seq.num_computed = 0
        self._pending.pop(seq.seq_id, None)

    # -- adoption ----------------------------------------------------------------------------------------
    def adopt(self, seqs: Iterable[Sequence], hold: Iterable[int] = ()) -> None:
        """Rebuild reference counts, pool and hashes from sequences whose block tables come from a journal
        (a successor taking over a dead engine's KV). Everything is checked before anything changes; a table
        that breaks the invariants raises `AdoptionError` naming the sequence and block. `hold`: blocks a dead
        engine may still write (isolation.py), in no table and out of the pool until `give_back`."""
        if self.num_free_blocks != self.num_blocks:
            raise AdoptionError("adopt needs a block manager that holds no blocks")
        seqs = list(seqs)
        held = set(hold)
        owner: dict[int, tuple[Sequence, int]] = {}
        refs: Counter[int] = Counter()
        for seq in seqs:
            self._check_table(seq)
            for j, b in enumerate(seq.block_table):
                if b in owner:
                    self._check_shared(owner[b], (seq, j), b)
                else:
                    owner[b] = (seq, j)
                refs[b] += 1
        if held & refs.keys():
            raise AdoptionError(f"blocks {sorted(held & refs.keys())[:8]} are both held back and in a table")
        for b, n in refs.items():
            self._ref[b] = n
        self._empty = blocks_except(self.num_blocks, refs.keys() | held)
        self._held = held
        if self.prefix_caching:
            self._pending = {s.seq_id: s for s in seqs}  # registered later (invariant 6)

    def register_pending(self) -> None:
        """Register the blocks of the adopted sequences still held (invariant 6): every full, computed block,
        those they computed since included. Cheap once done."""
        if not self._pending:
            return
        seqs = [s for s in self._pending.values() if s.block_table]
        self._pending = {}
        self._register_adopted(seqs, Counter({b: self._ref[b] for s in seqs for b in s.block_table}))

    def give_back(self) -> list[int]:
        """The blocks `adopt` held back, into the pool (their writer is gone); returns them."""
        back, self._held = sorted(self._held), set()
        self._empty.extend(back)
        return back

    def _register_adopted(self, seqs: list[Sequence], refs: Counter[int]) -> None:
        """Hash every full computed block; where two blocks hold the same content (computed side by side),
        the shared one keeps the hash, so that a block in two tables is registered (invariant 2)."""
        found = []
        for seq in seqs:
            n = seq.num_computed // self.block_size
            hashes = self.token_block_hashes(seq, n)[:n]
            found += [(refs[b], b, h) for b, h in zip(seq.block_table[:n], hashes, strict=True)]
        for _, b, h in sorted(found, key=lambda c: -c[0]):
            if h not in self._by_hash and self._hash_of[b] is None:
                self._by_hash[h] = b
                self._hash_of[b] = h

    def _check_table(self, seq: Sequence) -> None:
        table, bs = seq.block_table, self.block_size
        lo, hi = _ceil_div(seq.num_computed, bs), _ceil_div(len(seq.tokens), bs)
        if not lo <= len(table) <= hi:
            raise AdoptionError(f"sequence {seq.seq_id}: {len(table)} blocks for {seq.num_computed} computed "
                                f"of {len(seq.tokens)} tokens (needs {lo}..{hi})")
        for b in table:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise AdoptionError(f"sequence {seq.seq_id}: block id {b!r} outside 0..{self.num_blocks - 1}")
        if len(set(table)) != len(table):
            raise AdoptionError(f"sequence {seq.seq_id}: a block listed twice in its table {table}")

    def _check_shared(self, first: tuple[Sequence, int], second: tuple[Sequence, int], b: int) -> None:
        """A block in two tables is valid only as a shared prefix block (invariant 2)."""
        (s1, j1), (s2, j2) = first, second
        bs = self.block_size
        full = all((j + 1) * bs <= s.num_computed for s, j in (first, second))
        if j1 != j2 or not full or (self.token_block_hashes(s1, j1 + 1)[j1]
                                    != self.token_block_hashes(s2, j2 + 1)[j2]):
            raise AdoptionError(f"block {b} held by sequences {s1.seq_id} (index {j1}) and {s2.seq_id} "
                                f"(index {j2}) but is not a shared, computed prefix block of both")
