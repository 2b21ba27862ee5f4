"""KV backup to host (issue 22 item 4, FailSafe's): what a backup round copies and what it may vouch for. Pure: no
torch, no threads (backup.py is the adapter that copies and writes).

The backup lease (host memory, held by the gpu_manager's keeper like any lease) holds a block-major copy of the
paged KV cache (`bk_kv`, `[num_blocks, units, 2, block_size, kv heads a unit, head_dim]`: one block contiguous) and a
journal of its own (the main journal's tensors under `bk_` names, journal.py's format and ordering). A round:
1. every backup row whose sequence left the main journal (or was admitted again) is released (epoch 0) first, so
   that no row vouches for a block this round may overwrite with another sequence's KV;
2. the blocks holding each sequence's positions computed since the last round are copied, the partial last block
   whole (positions past the committed ones are garbage the rows never vouch for; the block is copied again, whole,
   by the next round that sees it grow);
3. only then each row: admitted (check last) or grown (new blocks, then new tokens), then its progress
   `length << 32 | durable` in one store.
So a row's progress vouches for KV that was copied before it was written: a copy cut off by the engine's death is
never vouched for (the progress of its round is not there yet), and a row cut off mid-admission fails its check
(journal.py invariants 1-3, the same argument). A row names only blocks its sequence held during the whole copy: a
sequence released while its round ran (its blocks may have been reused) is left out of that round's rows.

`durable` is the committed `computed`, except inside the prompt in deterministic mode, where it is cut down to a
multiple of `prefill_chunk` (the successor recomputes the rest in the same chunk shapes as the first run, so its
numerics, hence its greedy tokens, are the uninterrupted run's). Positions past it (at most the lag's worth of
decode, plus that cut) are recomputed by the successor from the backed tokens and counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from libs.common.events import KV_BACKUP_LEASE

BACKUP_NAME = KV_BACKUP_LEASE  # the lease's name and its cache tensor's: the name the gpu_manager knows a backup by
PREFIX = "bk_"  # the backup journal's tensors: jr_rows -> bk_rows ...


def durable_point(computed: int, prompt_len: int, chunk: int | None) -> int:
    """The positions a backup may vouch for, of `computed` committed: all of them past the prompt; inside the prompt,
    with `chunk` (deterministic mode), only whole chunks."""
    if chunk is None or computed >= prompt_len:
        return computed
    return computed // chunk * chunk


def blocks_between(table: Sequence[int], lo: int, hi: int, block_size: int) -> list[int]:
    """The blocks of `table` holding positions [lo, hi)."""
    if hi <= lo:
        return []
    return list(table[lo // block_size: -(-hi // block_size)])


def block_runs(blocks: Iterable[int]) -> list[tuple[int, int]]:
    """Distinct block ids as (first, count) runs of consecutive ids, ascending: one copy a run."""
    runs: list[tuple[int, int]] = []
    for b in sorted(set(blocks)):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def group_restores(ranks: Sequence[tuple[bool, bool]]) -> bool:
    """Whether the ranks restore their caches from their backups at start-up, from each rank's (cache handed on,
    backup handed on and fitting), in rank order: when some rank's cache was lost and every rank holds a backup.
    Then every rank restores, a handed-on cache too: rank 0's backup rows say which positions every rank's cache
    holds (the ranks' caches must hold the same ones: tp.py invariant 1), and rank 0's journal is rewritten from
    them. One rank alone: its cache lost and its backup there."""
    return any(not handed_on for handed_on, _ in ranks) and all(backed for _, backed in ranks)


@dataclass
class RowMirror:
    """One main-journal row as committed, kept in Python by the step thread (backup.BackedJournal)."""

    epoch: int  # the main journal's admission epoch: a row admitted again is another sequence
    admission: object  # journal.Admission (immutable)
    prompt_len: int
    tokens: list[int]
    blocks: list[int]
    length: int
    computed: int
    gap: bool = False  # a commit skipped tokens this mirror never saw: not backed up (replayed by the router)


@dataclass(frozen=True)
class RowSnap:
    """What a round takes of a row: its tokens past what the backup has, its whole block table."""

    slot: int
    epoch: int
    admission: object
    prompt_len: int
    new_tokens: tuple[int, ...]  # tokens [backed length, length)
    blocks: tuple[int, ...]
    length: int
    computed: int


@dataclass
class Backed:
    """A main row as the backup holds it: its backup slot, and how far it is copied and vouched for."""

    epoch: int
    bslot: int
    length: int  # tokens written to the backup row
    copied: int  # positions whose KV is copied (the committed computed of its last round)
    durable: int  # what its progress vouches for
    n_blocks: int
    prompt_len: int = 0


@dataclass(frozen=True)
class RoundPlan:
    releases: tuple[int, ...]  # main slots whose backup rows go first
    blocks: tuple[int, ...]  # to copy, ascending
    rows: tuple[RowSnap, ...]


def snap_rows(rows: dict[int, RowMirror], book: dict[int, Backed]) -> list[RowSnap]:
    """A round's view of the committed rows (under the mirror's lock: only list copies)."""
    out = []
    for slot, m in rows.items():
        if m.gap:
            continue
        b = book.get(slot)
        have = b.length if b is not None and b.epoch == m.epoch else 0
        out.append(RowSnap(slot, m.epoch, m.admission, m.prompt_len, tuple(m.tokens[have:m.length]),
                           tuple(m.blocks), m.length, m.computed))
    return out


def plan_round(snaps: list[RowSnap], book: dict[int, Backed], block_size: int) -> RoundPlan:
    """Which backup rows go, which blocks are copied, which rows are written (in that order: the module's 1-3)."""
    live = {s.slot: s for s in snaps}
    releases = tuple(slot for slot, b in book.items() if slot not in live or live[slot].epoch != b.epoch)
    blocks: list[int] = []
    rows = []
    for s in snaps:
        b = book.get(s.slot)
        copied = b.copied if b is not None and b.epoch == s.epoch else 0
        if s.computed == copied and b is not None and b.epoch == s.epoch and s.length == b.length:
            continue  # nothing new
        blocks += blocks_between(s.blocks, copied, s.computed, block_size)
        rows.append(s)
    return RoundPlan(releases, tuple(sorted(set(blocks))), tuple(rows))


@dataclass
class LagClock:
    """How far behind the backup runs: a token committed just after round k's snapshot is durable once round k+1 is
    done, so each round's bound is its end minus the previous round's snapshot."""

    last_snapshot: float | None = None
    lags_ms: list[float] = field(default_factory=list)
    KEEP = 512

    def round_done(self, snapshot_at: float, done_at: float) -> float | None:
        lag = None if self.last_snapshot is None else (done_at - self.last_snapshot) * 1000
        self.last_snapshot = snapshot_at
        if lag is not None:
            self.lags_ms.append(lag)
            del self.lags_ms[:-self.KEEP]
        return lag

    def stats(self) -> dict[str, float | None]:
        xs = sorted(self.lags_ms)
        if not xs:
            return {"p50": None, "p99": None, "max": None}
        return {"p50": round(xs[len(xs) // 2], 2), "p99": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))], 2),
                "max": round(xs[-1], 2)}
