"""KV backup to host, the adapter (kv_backup.py has the rules and the argument): the backup lease's tensors, the
journal that mirrors its committed rows for the writer, the writer thread, and a successor's restore.

- `BackedJournal`: the engine's journal (journal.py, unchanged on its tensors) that also keeps each committed row in
  Python (`RowMirror`) under a lock: the step thread pays for list appends, nothing else. The writer starts with
  the first commit (after the start-up adopted or restored whatever it had).
- `BackupWriter`: one thread. Every `lag_ms / 2` (when something was committed since its last round) it snapshots
  the mirror, releases the backup rows of sequences that left, copies the new blocks (copier.py: a side CUDA
  stream into registered host memory, or a plain copy on the CPU), drops the rows whose sequence left meanwhile,
  then writes the rows and their progress. Never on the step's critical path: on CUDA the copy waits for an event
  recorded on the step's stream and runs on its own stream; on the CPU it is one more thread.
- `restore`: a successor whose KV lease was lost but whose backup lease was handed on (memory.py `_rebuild` sized
  the new cache as the backup's) copies every vouched-for block back into the new cache and writes the main
  journal from the backup's rows at their durable point, so that start-up adopts them as a handed-on cache
  (`Loaded.kv_handed_on`); the positions past it are recomputed (counted) from the backed tokens.
- Tensor parallel (`--tp N`): every rank backs up its own shard of the cache to a host lease of its own
  (`kv_backup.tp<N>-r<r>`), allocated before the group registers its gang, so the backups move with the gang. A
  rank is a rank: each runs this module over a `channel` (`SoloChannel` alone; tp_group.py `BackupChannel`, a gloo
  group of the backups' own, for a group). Rank 0's writer plans each round and shares its blocks; every other
  rank's writer copies the same blocks of its own shard (`_follow`); the rows are written only after every rank
  copied them (`channel.done()`), so rank 0's backup rows vouch for every rank's copy, as its journal vouches for
  every rank's cache (tp.py invariant 2); the other ranks' backup journals stay empty. At start-up the ranks decide
  together (kv_backup.py `group_restores`) and restore the blocks rank 0's rows vouch for, each from its own backup.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from engines.batched.copier import BlockCopier
from engines.batched.journal import COUNT_MASK, EPOCH, Admission, Journal, JournalLayout
from engines.batched.kv_backup import (
    BACKUP_NAME,
    PREFIX,
    Backed,
    LagClock,
    RowMirror,
    blocks_between,
    durable_point,
    plan_round,
    snap_rows,
)

log = logging.getLogger("holdfast.engine.batched.backup")
ALIGN = 256
STALL_ROUNDS = 50  # a round running this many lag bounds is stuck (`BackupWriter.stalled`)...
STALL_MIN_S = 5.0  # ...and at least this long (a loaded CPU's rounds take hundreds of ms)


def backup_kv_shape(kv_shape: tuple[int, ...]) -> tuple[int, ...]:
    """`[layers, 2, blocks, block_size, heads, dim]` -> block-major `[blocks, layers, 2, block_size, heads, dim]`."""
    n_layers, two, blocks, bs, heads, dim = kv_shape
    return (blocks, n_layers, two, bs, heads, dim)


def packed(kv_shape: tuple[int, ...], dtype: torch.dtype, layout: JournalLayout) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    """(name, dtype, shape, byte offset) of the backup lease's tensors: the block-major cache, then its journal."""
    items = [(BACKUP_NAME, dtype, backup_kv_shape(kv_shape))]
    items += [(PREFIX + n[3:], dt, shape) for n, (dt, shape) in layout.tensors().items()]
    out, off = [], 0
    for name, dt, shape in items:
        out.append((name, dt, shape, off))
        off = -(-(off + torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()) // ALIGN) * ALIGN
    return out


def lease_bytes(kv_shape: tuple[int, ...], dtype: torch.dtype, layout: JournalLayout) -> int:
    _, dt, shape, off = packed(kv_shape, dtype, layout)[-1]
    return off + torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()


def backup_journal(layout: JournalLayout, tensors: dict[str, torch.Tensor]) -> Journal:
    return Journal(layout, {"jr_" + n[len(PREFIX):]: t for n, t in tensors.items() if n != BACKUP_NAME})


class SoloChannel:
    """An engine of one rank: its backup's rounds and start-up decide alone (tp_group.py `BackupChannel`: a group)."""

    rank = 0

    def gather(self, mine: Any) -> list[Any]:
        return [mine]

    def share(self, value: Any) -> Any:
        return value

    def done(self) -> None:
        pass


SOLO = SoloChannel()


class BackedJournal(Journal):
    """The main journal, each committed row also mirrored in Python for the backup writer (step thread only writes)."""

    def __init__(self, layout: JournalLayout, tensors: dict[str, torch.Tensor], writer: BackupWriter) -> None:
        super().__init__(layout, tensors)
        self.writer = writer
        self.lock = threading.Lock()
        self.mirror: dict[int, RowMirror] = {}
        self.version = 0  # bumped by every change: the writer skips a round when nothing changed
        self.released: set[int] = set()  # slots released since the writer's last snapshot

    def quiet(self) -> Any:
        """No backup round runs meanwhile: a round's CUDA calls from another thread would break a graph capture
        (global capture mode)."""
        return self.writer.paused()

    def format(self, gen: int | None = None) -> None:
        super().format(gen)
        with self.lock:
            self.released.update(self.mirror)
            self.mirror.clear()
            self.version += 1

    def recover(self, busy: frozenset[int] = frozenset()) -> tuple[list[Any], int]:
        entries, dropped = super().recover(busy)
        epochs = self.rows[:, EPOCH].cpu().tolist()
        with self.lock:
            for e in entries:
                self.mirror[e.slot] = RowMirror(int(epochs[e.slot]) & COUNT_MASK, _admission_of(e), e.prompt_len, list(e.tokens),
                                                list(e.block_table), len(e.tokens), e.computed)
            self.version += 1
        return entries, dropped

    def admit(self, a: Admission, block_table: Any) -> int | None:
        slot = super().admit(a, block_table)
        if slot is not None:
            with self.lock:
                self.mirror[slot] = RowMirror(self._epoch, a, a.prompt_len, list(a.tokens), list(block_table),
                                              len(a.tokens), 0)
                self.version += 1
        return slot

    def grow_many(self, tables: Any) -> None:
        super().grow_many(tables)
        for slot, block_table in tables:
            m = self.mirror.get(slot)
            if m is not None and len(block_table) > len(m.blocks):
                with self.lock:
                    m.blocks = list(block_table)

    def write_tokens(self, slot: int, start: int, tokens: Any) -> None:
        super().write_tokens(slot, start, tokens)
        m = self.mirror.get(slot)
        if m is not None and tokens and len(m.tokens) >= start:
            with self.lock:
                m.tokens[start:] = list(tokens)  # a claim's tokens past the journal: the row stays whole
                self.version += 1

    def commit(self, updates: Any) -> None:
        super().commit(updates)
        with self.lock:
            for slot, n, c, t in updates:
                m = self.mirror.get(slot)
                if m is None:
                    continue
                if t is not None:
                    if len(m.tokens) == n - 1:
                        m.tokens.append(t)
                    elif len(m.tokens) >= n:
                        m.tokens[n - 1] = t
                if len(m.tokens) < n:
                    m.gap = True  # tokens this mirror never saw (none since write_tokens): not backed up
                m.length, m.computed = n, c
            self.version += 1
        self.writer.start()

    def release(self, slot: int) -> None:
        super().release(slot)
        with self.lock:
            self.mirror.pop(slot, None)
            self.released.add(slot)
            self.version += 1


def _admission_of(e: Any) -> Admission:
    return Admission(e.seq_id, e.request_id, e.tokens, e.prompt_len, e.max_tokens, e.temperature, e.seed, e.ignore_eos)


class BackupWriter:
    """The writer thread and its book (main slot -> `Backed`); `stats` is a dict updated in place (health reads it)."""

    def __init__(self, kv: torch.Tensor, tensors: dict[str, torch.Tensor], layout: JournalLayout, *, lag_ms: float,
                 chunk: int | None, thread: bool = True, channel: Any = SOLO) -> None:
        """`thread` False: no thread of its own; rounds run only when `round()` is called (tests). `channel`: this
        rank's (module docstring); a rank other than 0 only copies the blocks rank 0 shares (`start` it)."""
        self.copier = BlockCopier(kv, tensors[BACKUP_NAME])
        self.channel = channel
        self.bj = backup_journal(layout, tensors)
        self.block_size = layout.block_size
        self.interval_s = lag_ms / 2000.0
        self.lag_ms = lag_ms
        self.chunk = chunk
        self.book: dict[int, Backed] = {}
        self.journal: BackedJournal | None = None
        self.lag = LagClock()
        self._seen = -1
        self._thread: threading.Thread | None = None
        self._threaded = thread
        self._round = threading.Lock()  # one round at a time
        self._stop = threading.Event()
        self._said: object = None  # the stall last said (`stalled`)
        self.stats: dict[str, Any] = {"lag_ms_bound": lag_ms, "rounds": 0, "blocks_copied": 0, "bytes_copied": 0,
                                      "rows": 0, "rows_max": 0, "durable_tokens": 0, "round_ms_last": None,
                                      "round_ms_max": 0.0, "lag_ms": self.lag.stats(),
                                      "left_out_released": 0, "error": None, "stalls": 0,
                                      # wall clock of the last done round's snapshot (what the backup is current
                                      # as of), and of the running round's (None between rounds)
                                      "durable_as_of": None, "in_round_since": None}

    # ------------------------------------------------------------------ set-up
    def fresh(self) -> None:
        """A backup that vouches for nothing yet (a new lease, or one whose rows this engine does not take on)."""
        self.bj.format()
        self.book.clear()

    def adopt(self, book: dict[int, Backed]) -> None:
        """Rows restored from this backup: they stay vouched for, and are only grown from here."""
        self.book = dict(book)

    def start(self) -> None:
        if self._thread is None and self._threaded:
            loop = self._loop if self.channel.rank == 0 else self._follow
            self._thread = threading.Thread(target=loop, name="kv-backup", daemon=True)
            self._thread.start()

    def paused(self) -> threading.Lock:
        return self._round

    def stop(self) -> None:
        """Rank 0: no round after this one, and the other ranks' writers told to end (`share(None)`), unless a
        round failed half way (its peers may wait in another collective: they end with their processes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        ended = self._thread is None or not self._thread.is_alive()
        if self.channel is not SOLO and self.channel.rank == 0 and self.stats["error"] is None and ended:
            self.channel.share(None)
        if ended:
            self.copier.close()

    def stalled(self, now: float) -> str | None:
        """What is wrong with a writer that should be running (rank 0's, once started), said once per stall: a round
        running past `STALL_ROUNDS` lag bounds (at least `STALL_MIN_S`), or the thread gone without an error. None
        while it keeps up (or was never started: nothing was committed yet)."""
        if self._thread is None or self._stop.is_set() or self.stats["error"] is not None:
            return None
        since = self.stats["in_round_since"]
        if not self._thread.is_alive():
            why = "the KV backup's writer thread ended without an error"
            key: object = "ended"
        elif since is not None and now - since > max(STALL_MIN_S, STALL_ROUNDS * self.lag_ms / 1000):
            why = (f"a KV backup round has run {now - since:.1f} s (bound {self.lag_ms:g} ms): the backup vouches for "
                   "nothing newer until it ends")
            key = since
        else:
            return None
        if key == self._said:
            return None
        self._said = key
        self.stats["stalls"] += 1
        return why

    def join(self, timeout_s: float = 10.0) -> None:
        """A rank other than 0: wait for its writer to end (rank 0's `stop`)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._thread is None or not self._thread.is_alive():
            self.copier.close()

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self.round()
        except Exception as e:  # noqa: BLE001 - the backup stops; serving goes on (a lost GPU then replays)
            log.exception("the KV backup failed; it vouches for nothing newer from here")
            self.stats["error"] = repr(e)

    def _follow(self) -> None:
        """A rank other than 0: each round, the blocks rank 0 shares copied from this rank's shard, then the barrier
        after which rank 0 writes the rows that vouch for them; until rank 0 shares None."""
        try:
            while (blocks := self.channel.share(None)) is not None:
                self.copier.copy(blocks, self.copier.mark())
                self.channel.done()
                self.stats.update(rounds=self.stats["rounds"] + 1,
                                  blocks_copied=self.stats["blocks_copied"] + len(blocks))
        except Exception as e:  # noqa: BLE001 - rank 0's round fails on the barrier; the group serves on
            log.exception("the KV backup's copy of this rank's shard failed")
            self.stats["error"] = repr(e)

    def round(self) -> bool:
        """One round (module docstring of kv_backup.py, 1-3); False: nothing was committed since the last."""
        with self._round:
            return self._round_locked()

    def _round_locked(self) -> bool:
        j = self.journal
        assert j is not None
        with j.lock:
            if j.version == self._seen:
                return False
            self._seen = j.version
            snaps = snap_rows(j.mirror, self.book)
            j.released.clear()
            after = self.copier.mark()  # every committed step's KV writes are before it in the step's stream
        t0, wall = time.perf_counter(), time.time()
        self.stats["in_round_since"] = wall
        plan = plan_round(snaps, self.book, self.block_size)
        for slot in plan.releases:  # 1: no row vouches for a block this round may overwrite
            self.bj.release(self.book.pop(slot).bslot)
        self.channel.share(list(plan.blocks))  # every other rank copies the same blocks of its shard
        self.copier.copy(plan.blocks, after)  # 2
        self.channel.done()  # every rank's copy is done: from here a row may vouch for it
        with j.lock:
            gone = set(j.released)  # left while the copy ran: their blocks may hold another sequence's KV now
        for s in plan.rows:  # 3
            if s.slot in gone:
                self.stats["left_out_released"] += 1
                continue
            self._write_row(s)
        done = time.perf_counter()
        self.lag.round_done(t0, done)
        ms = (done - t0) * 1000
        self.stats.update(rounds=self.stats["rounds"] + 1, blocks_copied=self.stats["blocks_copied"] + len(plan.blocks),
                          bytes_copied=self.stats["bytes_copied"] + len(plan.blocks) * self.copier.block_bytes,
                          rows=len(self.book), rows_max=max(len(self.book), self.stats["rows_max"]),
                          durable_tokens=sum(b.length - b.prompt_len for b in self.book.values()),
                          round_ms_last=round(ms, 2), round_ms_max=round(max(ms, self.stats["round_ms_max"]), 2),
                          lag_ms=self.lag.stats(), durable_as_of=wall, in_round_since=None)
        return True

    def _write_row(self, s: Any) -> None:
        b = self.book.get(s.slot)
        durable = durable_point(s.computed, s.prompt_len, self.chunk)
        if b is None or b.epoch != s.epoch:
            a: Admission = s.admission  # type: ignore[assignment]
            tokens = list(s.new_tokens)
            bslot = self.bj.admit(Admission(a.seq_id, a.request_id, tokens, s.prompt_len, a.max_tokens,
                                            a.temperature, a.seed, a.ignore_eos), s.blocks)
            if bslot is None:
                return
            b = self.book[s.slot] = Backed(s.epoch, bslot, s.length, 0, 0, len(s.blocks), s.prompt_len)
        else:
            self.bj.grow(b.bslot, s.blocks)
            if s.new_tokens:
                self.bj.tokens[b.bslot, b.length:s.length] = torch.tensor(s.new_tokens, dtype=torch.int32)
        self.bj.commit([(b.bslot, s.length, durable, None)])  # progress last, one store
        b.length, b.copied, b.durable, b.n_blocks = s.length, s.computed, durable, len(s.blocks)


def restore(tensors: dict[str, torch.Tensor], kv: torch.Tensor, journal: Journal, layout: JournalLayout,
            channel: Any = SOLO) -> tuple[dict[str, Any], dict[int, Backed]]:
    """The backup's vouched-for rows and blocks into a new cache and a formatted main journal; the book of the rows
    restored (main slot -> Backed) for the writer. `tensors`: the handed-on backup lease's. In a group every rank
    restores the blocks rank 0's rows vouch for (shared), each from its own backup; only rank 0's rows are written."""
    t0 = time.perf_counter()
    ok, entries, dropped, covered = vouched(tensors, layout)
    matches, restored, blocks = channel.share((ok, len(entries), covered))
    if not matches:
        return {"restored": 0, "why": "the backup was written for another layout"}, {}
    copier = BlockCopier(kv, tensors[BACKUP_NAME])
    copier.restore(blocks)
    book = rows_into(journal, entries)
    if kv.device.type == "cuda":
        torch.cuda.synchronize(kv.device)
    info = {"restored": restored, "dropped": dropped, "blocks": len(blocks), "bytes": len(blocks) * copier.block_bytes,
            "recomputed_tokens": sum(len(e.tokens) - 1 - e.computed for e in entries),
            "ms": round((time.perf_counter() - t0) * 1000, 3)}
    return info, book


def vouched(tensors: dict[str, torch.Tensor], layout: JournalLayout) -> tuple[bool, list[Any], int, list[int]]:
    """What a backup's rows vouch for: whether they were written for `layout`, the rows (recovered), how many were
    dropped, and every block they cover up to their computed positions."""
    bj = backup_journal(layout, tensors)
    entries, dropped = bj.recover() if bj.matches() else ([], 0)
    bs = layout.block_size
    return bj.matches(), entries, dropped, sorted({b for e in entries for b in blocks_between(e.block_table, 0, e.computed, bs)})


def rows_into(journal: Journal, entries: list[Any]) -> dict[int, Backed]:
    """Backed-up rows written as the main journal's (formatted first), each committed at its computed positions:
    start-up then adopts them as a handed-on cache's. The book of them (main slot -> Backed)."""
    journal.format()
    book: dict[int, Backed] = {}
    for e in entries:
        slot = journal.admit(_admission_of(e), e.block_table)
        if slot is None:
            continue
        journal.commit([(slot, len(e.tokens), e.computed, None)])
        book[slot] = Backed(journal._epoch, e.slot, len(e.tokens), e.computed, e.computed, len(e.block_table),
                            e.prompt_len)
    return book


def backed_journal(writer: BackupWriter, layout: JournalLayout, tensors: dict[str, torch.Tensor]) -> BackedJournal:
    journal = BackedJournal(layout, tensors, writer)
    writer.journal = journal
    return journal
