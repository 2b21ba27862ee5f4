"""The step journal: what a successor needs to continue every in-flight sequence, kept in the KV lease beside
the paged cache, so it outlives the engine process exactly as the cache does.

Layout (tensors registered in the KV lease, after `kv_cache`):
- `jr_header` int64[8]: magic, version, block_size, num_blocks, slots, max_len, max_blocks, generation. A
  successor whose configuration gives another header (the first seven) cannot read the cache and leases a new one.
- `jr_rows` int64[slots, 10], one row per journal slot (a running sequence holds one):
  epoch (0: empty; `generation << 32 | admission count`), seq_id, prompt_len, max_tokens, temperature (float64 bits), seed, flags (bit 0: ignore_eos; bits 8-15: adoptions, invariant 8),
  n_blocks, check (crc32 of the admission: the fields before n_blocks, the request id and the prompt tokens),
  progress (`length << 32 | computed`: tokens known, positions whose KV is written).
- `jr_tokens` int32[slots, max_len]: the sequence's tokens (prompt, then each sampled one).
- `jr_blocks` int32[slots, max_blocks]: its block table.
- `jr_ids` uint8[slots, 64]: its request id (UTF-8, NUL-padded).

Ordering (the whole argument for "no recompute, nothing wrong"): every write goes in program order on the CPU
(shared memory of a memfd lease) and in stream order on CUDA (the step's forward and these writes are on one
stream), so a write that is visible implies every write queued before it is done.
1. Admission: the row's fields, id, prompt tokens and block table, then `check` last. A row whose check does
   not match was cut off while being admitted: the successor ignores it (its request comes back through the
   router's replay, prefilled from scratch).
2. A step: new block-table entries before the forward (the forward writes into those blocks); after it, the
   sampled tokens, then `progress` in ONE aligned 8-byte store (length and computed never torn apart).
3. So `progress` vouches for the tokens below `length` and the KV below `computed`. A step cut off by the death
   left at most KV past `computed` (half written, never read: the successor writes those positions again) and
   tokens past `length` (ignored). The successor redoes that step from the committed state; nothing else.
4. A finished, aborted or preempted sequence's row is emptied (epoch 0) before its blocks can be reused.
5. A journal vouches for a state that can go on, not one that failed: when the step loop fails (an exception, not
   a death from outside), the engine empties every row before it exits (`forget`), and its requests come back
   through the router's replay instead of being adopted (a request that ends the step loop would otherwise end
   every successor that adopts it). Not in a tensor-parallel group: there a rank's step loop most often fails
   because a peer rank died (its collective's error), and the successor group adopts the journal as ever.
6. Generations (isolation.py): a successor that does not wait for its predecessor's exit moves the rows that the
   dead engine may still write to other slots, stamps every row it keeps with the next generation, then writes that
   generation into the header. A reader adopts only rows of the header's generation: the dead engine's late writes
   land in rows of the one before (and in slots and blocks the successor holds back until the exit).
7. Every write is stamped in the engine's drain mark (`mark`, drain.py) before it is queued: its slot, or the
   header.
8. A row counts the successors that adopted it since it last made progress (`adopt`: written with the row's check
   before the adopter's first step; back to 0 by the first commit past the length it was adopted at). A row adopted
   MAX_ADOPTIONS times without progress is not adopted again: its request comes back through the router's replay.
   A request whose step kills the engine (in a tensor-parallel group, where invariant 5 does not empty the rows)
   thus ends at most MAX_ADOPTIONS successors, not every one.
"""

from __future__ import annotations

import contextlib
import struct
import time
import zlib
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch

from engines.batched.drain import NO_MARK, Mark
from libs.common.procs import ms_since

MAGIC = 0x484F4C444A524E4C  # "HOLDJRNL"
VERSION = 1
ID_BYTES = 64
GEN_SHIFT = 32
COUNT_MASK = (1 << GEN_SHIFT) - 1
(EPOCH, SEQ_ID, PROMPT_LEN, MAX_TOKENS, TEMP, SEED, FLAGS, N_BLOCKS, CHECK, PROGRESS) = range(10)
N_FIELDS = 10
FLAG_IGNORE_EOS = 1
ADOPT_SHIFT = 8  # flags bits 8-15: adoptions without progress (invariant 8)
MAX_ADOPTIONS = 2


@dataclass(frozen=True)
class JournalLayout:
    block_size: int
    num_blocks: int
    slots: int
    max_len: int

    @property
    def max_blocks(self) -> int:
        return -(-self.max_len // self.block_size)

    def header(self, gen: int = 0) -> list[int]:
        return [MAGIC, VERSION, self.block_size, self.num_blocks, self.slots, self.max_len, self.max_blocks, gen]

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Name -> (dtype, shape) of every journal tensor, in their order in the lease."""
        return {"jr_header": (torch.int64, (8,)), "jr_rows": (torch.int64, (self.slots, N_FIELDS)),
                "jr_tokens": (torch.int32, (self.slots, self.max_len)),
                "jr_blocks": (torch.int32, (self.slots, self.max_blocks)),
                "jr_ids": (torch.uint8, (self.slots, ID_BYTES))}


@dataclass(frozen=True)
class Entry:
    """One sequence as the journal committed it."""

    slot: int
    seq_id: int
    request_id: str
    tokens: list[int]
    prompt_len: int
    computed: int
    block_table: list[int]
    max_tokens: int
    temperature: float
    seed: int
    ignore_eos: bool
    adoptions: int = 0  # successors that adopted it without progress since (invariant 8)


@dataclass(frozen=True)
class Admission:
    seq_id: int
    request_id: str
    tokens: Seq[int]
    prompt_len: int
    max_tokens: int
    temperature: float
    seed: int
    ignore_eos: bool
    adoptions: int = 0


def _flags(ignore_eos: bool, adoptions: int) -> int:
    return (FLAG_IGNORE_EOS if ignore_eos else 0) | (min(adoptions, 0xFF) << ADOPT_SHIFT)


def _rid_raw(request_id: str) -> bytes:
    """A request id as its row holds it: UTF-8, cut to ID_BYTES, NUL-padded."""
    rid = request_id.encode()[:ID_BYTES]
    return rid + b"\0" * (ID_BYTES - len(rid))


def _fields(epoch: int, a: Admission | Entry) -> list[int]:
    """A row's fields before N_BLOCKS (those its check covers)."""
    return [epoch, a.seq_id, a.prompt_len, a.max_tokens, _f64_bits(a.temperature), a.seed,
            _flags(a.ignore_eos, a.adoptions)]


class JournalMismatch(ValueError):
    """The journal in a handed-on lease was written for another configuration (or is not a journal)."""


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_f64(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b)))[0]


def _check(fields: Seq[int], rid: bytes, prompt: Seq[int]) -> int:
    c = zlib.crc32(struct.pack(f"<{len(fields)}q", *fields))
    c = zlib.crc32(rid, c)
    return zlib.crc32(struct.pack(f"<{len(prompt)}i", *prompt), c)


def _progress(length: int, computed: int) -> int:
    return (length << 32) | computed


def on_device(device: torch.device, values: Seq[int] | bytes, dtype: torch.dtype) -> torch.Tensor:
    """`values` as a tensor on `device`. On CUDA through pinned memory and a copy that does not wait: a pageable
    copy would wait for the whole stream (the step in flight), and the copy keeps its place in stream order,
    which is what the ordering below relies on. The pinned block is reused only once that copy is done (torch's
    pinned-memory cache records it)."""
    if isinstance(values, bytes):
        host = torch.frombuffer(bytearray(values), dtype=dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Journal:
    """Writes (engine side) and reads (successor side) the journal tensors. Not thread-safe: the engine's step
    thread is its only writer."""

    def __init__(self, layout: JournalLayout, tensors: dict[str, torch.Tensor]) -> None:
        self.layout = layout
        self.header, self.rows = tensors["jr_header"], tensors["jr_rows"]
        self.tokens, self.blocks, self.ids = tensors["jr_tokens"], tensors["jr_blocks"], tensors["jr_ids"]
        self.device = self.rows.device
        self._free = list(range(layout.slots - 1, -1, -1))
        self._epoch = 0  # admissions counted (a row's epoch below its generation)
        self.gen = 0  # the generation this journal's rows are written in (invariant 6)
        self.read_ms: float | None = None  # the last `recover`'s copies from the device
        self._n_blocks: dict[int, int] = {}  # slot -> block-table entries written
        self.mark: Mark = NO_MARK  # invariant 7
        # invariant 8: slot -> (length when adopted, row fields, request id, prompt) of adopted rows not advanced yet
        self._adopted: dict[int, tuple[int, list[int], bytes, list[int]]] = {}
        self._epochs: dict[int, int] = {}  # a recovered row's epoch, by slot (`adopt` writes its fields again)
        self._read: dict[int, Entry] = {}  # what `recover` read in each slot, until `rehome` (what it need not write)

    def quiet(self) -> contextlib.AbstractContextManager[object]:
        """Held while CUDA graphs are captured: a journal with a thread of its own (backup.py) pauses it."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ creation and recovery
    def format(self, gen: int | None = None) -> None:
        """A new journal: every slot empty, then the header (a successor trusts nothing without it), in generation
        `gen` (None: this journal's, as after a wake: the drain mark's bank follows it)."""
        gen = self.gen if gen is None else gen
        self.mark.touch_header()
        self.mark.touch_slots(range(self.layout.slots))
        self.rows.zero_()
        self.header.copy_(torch.tensor(self.layout.header(gen), dtype=torch.int64))
        self.gen, self._epoch, self._n_blocks = gen, 0, {}
        self._free = list(range(self.layout.slots - 1, -1, -1))

    def matches(self) -> bool:
        return self.generation() is not None

    def generation(self) -> int | None:
        """The header's generation, None when the header is not this layout's (no journal to read)."""
        h = [int(x) for x in self.header.cpu().tolist()]
        return h[7] if h[:7] == self.layout.header()[:7] else None

    def recover(self, busy: frozenset[int] = frozenset()) -> tuple[list[Entry], int]:
        """The committed sequences of the header's generation (and the number of slots dropped as cut off
        mid-admission or inconsistent). The slots they hold stay taken; the rest are free, but for `busy` slots (a
        dead engine may still write them: drain.py `Pending`), which are neither written nor handed out."""
        gen = self.generation()
        if gen is None:
            raise JournalMismatch(f"journal header {self.header.cpu().tolist()} != {self.layout.header()}")
        self.gen = gen
        self._epochs = {}
        t0 = time.perf_counter()
        rows = self.rows.cpu().tolist()  # rows first: a later read of the rest is at least as new (invariant 2)
        # Of the rest, only as far as the longest of the rows' lengths: at a few hundred tokens a sequence, some
        # hundred KB come from the device instead of every slot's max_len (MBs, copied through pageable memory on
        # the recovery's path). A length past max_len is cut there (`_entry` drops its row).
        used = [slot for slot, r in enumerate(rows) if r[EPOCH] != 0]
        span = max((min(rows[u][PROGRESS] >> 32, self.layout.max_len) for u in used), default=0)
        toks = self.tokens[:, :span].cpu().numpy()
        blocks = self.blocks[:, :-(-span // self.layout.block_size)].cpu().numpy()
        ids = self.ids.cpu().numpy()
        self.read_ms = ms_since(t0)  # of `recover`: the copies from the device
        out: list[Entry] = []
        dropped = 0
        for slot in used:
            r = rows[slot]
            e = self._entry(slot, r, toks[slot].tolist(), blocks[slot].tolist(), ids[slot].tobytes())
            if e is None or r[EPOCH] >> GEN_SHIFT != gen:  # cut off, or a dead engine's late row (invariant 6)
                dropped += e is None
                if slot not in busy:
                    self._clear(slot)
                continue
            out.append(e)
            self._epochs[slot] = r[EPOCH]
            self._epoch = max(self._epoch, r[EPOCH] & COUNT_MASK)
        taken = {e.slot for e in out}
        self._free = [s for s in range(self.layout.slots - 1, -1, -1) if s not in taken and s not in busy]
        for e in out:
            self._n_blocks[e.slot] = len(e.block_table)
        self._read = {e.slot: e for e in out}
        return out, dropped

    def free_slot_ids(self) -> list[int]:
        """The free slots, in the order `admit` takes them."""
        return self._free[::-1]

    def rehome(self, entries: Seq[Entry], gen: int) -> None:
        """Invariant 6: every entry written again in generation `gen` at its (possibly new) slot with its (possibly
        new) block table, then the header: one host-to-device copy whatever the count (their order among themselves
        does not matter, as no reader takes a row of `gen` before the header says `gen`). The slots the entries left
        stay out of the free list (the dead engine may still write them): `give_back` returns them.

        Of a row that stays in its slot only the fields and the block-table entries that changed are written: its
        request id and tokens are those `recover` read there, and nothing writes that slot any more (the dead
        engine's queue writes pending slots only, isolation.py rule 1). At 64 rows of a few hundred tokens, writing
        every token again was ~2-3 ms of the takeover's way to ready (H100, 2026-12-06)."""
        taken = {e.slot for e in entries}
        self._free = [s for s in self._free if s not in taken]
        self._n_blocks = {}  # the rows left behind are no longer this journal's
        self.mark.touch_slots(taken)
        slots: list[int] = []
        rows: list[int] = []
        b_slot: list[int] = []  # block-table entries written: slot, column, block
        b_col: list[int] = []
        b_val: list[int] = []
        t_slot: list[int] = []  # tokens written (rows in new slots only): slot, position, token
        t_pos: list[int] = []
        t_val: list[int] = []
        id_slots: list[int] = []
        ids = bytearray()
        for e in entries:
            self._epoch += 1
            rid_raw = _rid_raw(e.request_id)
            fields = _fields(gen << GEN_SHIFT | self._epoch, e)
            self._adopted[e.slot] = (len(e.tokens), fields, rid_raw, list(e.tokens[:e.prompt_len]))
            slots.append(e.slot)
            rows += fields
            rows += (len(e.block_table), _check(fields, rid_raw, e.tokens[:e.prompt_len]),
                     _progress(len(e.tokens), e.computed))
            was = self._read.get(e.slot)
            old: Seq[int] = ()
            if was is None or was.request_id != e.request_id or was.tokens != e.tokens:
                id_slots.append(e.slot)
                ids += rid_raw
                t_slot += [e.slot] * len(e.tokens)
                t_pos += range(len(e.tokens))
                t_val += e.tokens
            else:
                old = was.block_table
            for j, b in enumerate(e.block_table):
                if j >= len(old) or old[j] != b:
                    b_slot.append(e.slot)
                    b_col.append(j)
                    b_val.append(b)
            self._n_blocks[e.slot] = len(e.block_table)
        self._read = {}
        if entries:
            n, nb, nt = len(slots), len(b_val), len(t_val)
            host = on_device(self.device, slots + rows + b_slot + b_col + b_val + t_slot + t_pos + t_val + id_slots
                       + list(ids), torch.int64)
            (d_slots, d_rows, d_b_slot, d_b_col, d_b_val, d_t_slot, d_t_pos, d_t_val, d_id_slots,
             d_ids) = host.split([n, n * N_FIELDS, nb, nb, nb, nt, nt, nt, len(id_slots), len(ids)])
            if id_slots:
                self.ids[d_id_slots] = d_ids.to(torch.uint8).view(len(id_slots), ID_BYTES)
            if nt:
                self.tokens[d_t_slot, d_t_pos] = d_t_val.to(torch.int32)
            if nb:
                self.blocks[d_b_slot, d_b_col] = d_b_val.to(torch.int32)
            self.rows[d_slots] = d_rows.view(n, N_FIELDS)
        self.mark.touch_header()
        self.header[7] = gen
        self.gen = gen

    def give_back(self, slots: Seq[int]) -> None:
        """Slots held back from a dead engine (`recover`'s `busy`), once it can write them no more: emptied, free."""
        for slot in slots:
            if slot not in self._free and slot not in self._n_blocks:
                self.release(slot)

    def _entry(self, slot: int, r: list[int], toks: list[int], blocks: list[int], rid_raw: bytes) -> Entry | None:
        """The row's sequence, or None when the row is cut off or inconsistent. `toks` and `blocks`: the slot's
        tokens and block table as far as `recover` read them (at least this row's length when it is valid)."""
        prompt_len, n_blocks = r[PROMPT_LEN], r[N_BLOCKS]
        length, computed = r[PROGRESS] >> 32, r[PROGRESS] & 0xFFFFFFFF
        L = self.layout
        if not (0 < prompt_len <= length <= L.max_len and 0 <= n_blocks <= L.max_blocks):
            return None
        prompt = toks[:prompt_len]
        if _check(r[:N_BLOCKS], rid_raw, prompt) != r[CHECK]:
            return None
        # Async scheduling writes a block-table entry for the position of a token still in flight before that
        # token is committed: blocks past the committed tokens hold only KV past `computed` and are not adopted.
        table = blocks[:min(n_blocks, -(-length // L.block_size))]
        # computed <= length - 1: the last known token's logits are what the next step needs; a torn window
        # could not leave it higher (progress is one store), but a successor never trusts past that.
        computed = min(computed, length - 1, n_blocks * L.block_size)
        if any(not 0 <= b < L.num_blocks for b in table):
            return None
        return Entry(slot=slot, seq_id=r[SEQ_ID], request_id=rid_raw.rstrip(b"\0").decode(errors="replace"),
                     tokens=toks[:length], prompt_len=prompt_len, computed=computed, block_table=table,
                     max_tokens=r[MAX_TOKENS], temperature=_bits_f64(r[TEMP]), seed=r[SEED],
                     ignore_eos=bool(r[FLAGS] & FLAG_IGNORE_EOS), adoptions=(r[FLAGS] >> ADOPT_SHIFT) & 0xFF)

    # ------------------------------------------------------------------ the engine's writes
    def free_slots(self) -> int:
        return len(self._free)

    def admit(self, a: Admission, block_table: Seq[int]) -> int | None:
        """A journal slot for a sequence about to run its first forward (None: the journal is full; the sequence
        then runs unjournaled and a failure replays it through the router)."""
        if not self._free or len(a.tokens) > self.layout.max_len:
            return None
        slot = self._free.pop()  # only once the row is known to encode: a refusal above takes no slot
        self._epoch += 1
        self._write_row(slot, a, block_table, self.gen << GEN_SHIFT | self._epoch, _progress(len(a.tokens), 0))
        return slot

    def _write_row(self, slot: int, a: Admission, block_table: Seq[int], epoch: int, progress: int) -> None:
        rid_raw = _rid_raw(a.request_id)
        prompt = list(a.tokens[: a.prompt_len])
        fields = _fields(epoch, a)
        check = _check(fields, rid_raw, prompt)  # n_blocks grows after admission: not covered
        fields.append(len(block_table))
        dev = self.device
        self.mark.touch_slots((slot,))
        self.ids[slot].copy_(on_device(dev, rid_raw, torch.uint8))
        self.tokens[slot, : len(a.tokens)] = on_device(dev, list(a.tokens), torch.int32)
        if block_table:
            self.blocks[slot, : len(block_table)] = on_device(dev, list(block_table), torch.int32)
        self._n_blocks[slot] = len(block_table)
        # progress, then the fields, the check last (invariant 1)
        row = fields + [check, progress]
        self.rows[slot, :CHECK] = on_device(dev, row[:CHECK], torch.int64)
        tail = on_device(dev, [row[PROGRESS], check], torch.int64)  # stores of tensors: a scalar store is one copy each
        self.rows[slot, PROGRESS] = tail[0]
        self.rows[slot, CHECK] = tail[1]

    def grow(self, slot: int, block_table: Seq[int]) -> None:
        """New block-table entries, before the forward that writes into them."""
        self.grow_many([(slot, block_table)])

    def grow_many(self, tables: Seq[tuple[int, Seq[int]]]) -> None:
        """`grow` of many rows at once, as one host-to-device copy (a step's rows that crossed into a new block: ~16
        a step at 256 streams), the entries before the counts (a reader that sees a count finds its entries)."""
        grown = [(slot, bt, n) for slot, bt in tables if len(bt) > (n := self._n_blocks.get(slot, 0))]
        if not grown:
            return
        self.mark.touch_slots(slot for slot, _, _ in grown)
        at: list[int] = []  # (slot, column) of each new entry
        entries: list[int] = []
        counts: list[int] = []  # (slot, count) of each row
        for slot, bt, n in grown:
            for j in range(n, len(bt)):
                at += (slot, j)
                entries.append(bt[j])
            counts += (slot, len(bt))
        k = len(entries)
        host = on_device(self.device, at + entries + counts, torch.int64)  # one copy; scalar stores would be one each
        pos, rows = host[:2 * k].view(k, 2), host[3 * k:].view(-1, 2)
        self.blocks[pos[:, 0], pos[:, 1]] = host[2 * k:3 * k].to(torch.int32)
        self.rows[rows[:, 0], N_BLOCKS] = rows[:, 1]
        for slot, bt, _ in grown:
            self._n_blocks[slot] = len(bt)

    def write_tokens(self, slot: int, start: int, tokens: Seq[int]) -> None:
        """Tokens a sequence took from elsewhere than its own steps (a claim's tokens past the journal) at positions
        `start..`: written before any progress that covers them (invariant 2), like a step's sampled token."""
        if tokens:
            self.mark.touch_slots((slot,))
            self.tokens[slot, start:start + len(tokens)] = on_device(self.device, list(tokens), torch.int32)

    def commit(self, updates: Seq[tuple[int, int, int, int | None]]) -> None:
        """After a step's forward: (slot, length, computed, token sampled at position length - 1 or None) per
        sequence. Tokens first, then each row's progress in one store (invariant 2)."""
        if not updates:
            return
        dev = self.device
        self.mark.touch_slots(u[0] for u in updates)
        sampled = [(s, n - 1, t) for s, n, _, t in updates if t is not None]
        if sampled:
            cols = on_device(dev, [s for s, _, _ in sampled] + [p for _, p, _ in sampled], torch.int64).view(2, -1)
            self.tokens[cols[0], cols[1]] = on_device(dev, [t for _, _, t in sampled], torch.int32)
        cols = on_device(dev, [u[0] for u in updates] + [_progress(n, c) for _, n, c, _ in updates], torch.int64).view(2, -1)
        self.rows[cols[0], PROGRESS] = cols[1]
        if self._adopted:
            self._progressed([(s, n) for s, n, _, _ in updates if s in self._adopted and n > self._adopted[s][0]])

    def adopt(self, entries: Seq[Entry]) -> tuple[list[Entry], list[Entry]]:
        """Invariant 8, in place (a successor that waited for its predecessor: nothing else writes these rows): the
        entries to adopt, their count raised in their rows, and those adopted MAX_ADOPTIONS times already, emptied.
        (An isolated successor raises the count in the rows it writes again: `counted`, then `rehome`.)"""
        kept, spent = counted(entries)
        for e in spent:
            self.release(e.slot)
        if kept:
            self.mark.touch_slots(e.slot for e in kept)
            rows = []
            for e in kept:
                rid_raw = _rid_raw(e.request_id)
                fields = _fields(self._epochs[e.slot], e)
                rows.append((e.slot, fields[FLAGS], _check(fields, rid_raw, e.tokens[:e.prompt_len])))
                self._adopted[e.slot] = (len(e.tokens), fields, rid_raw, list(e.tokens[:e.prompt_len]))
            self._rewrite_flags(rows)
        return kept, spent

    def _progressed(self, advanced: list[tuple[int, int]]) -> None:
        """Adopted rows past the length they were adopted at: their count back to 0 (invariant 8)."""
        rows = []
        for slot, _ in advanced:
            _, fields, rid_raw, prompt = self._adopted.pop(slot)
            fields = list(fields)
            fields[FLAGS] &= (1 << ADOPT_SHIFT) - 1
            rows.append((slot, fields[FLAGS], _check(fields, rid_raw, prompt)))
        if rows:
            self._rewrite_flags(rows)

    def _rewrite_flags(self, rows: list[tuple[int, int, int]]) -> None:
        """(slot, flags, check) per row: the flags, then the check (a reader between the two drops the row: its
        request replays, nothing wrong is adopted)."""
        dev = self.device
        slots = on_device(dev, [r[0] for r in rows], torch.int64)
        self.rows[slots, FLAGS] = on_device(dev, [r[1] for r in rows], torch.int64)
        self.rows[slots, CHECK] = on_device(dev, [r[2] for r in rows], torch.int64)

    def release(self, slot: int) -> None:
        """The sequence left (finished, aborted, preempted): its row emptied before its blocks are reused."""
        self._clear(slot)
        self._free.append(slot)

    def forget(self, slots: Seq[int]) -> None:
        """After a failed step: these rows emptied, and (CUDA) the writes done before the process exits, so that no
        successor adopts the state that failed (engine.py `_loop`)."""
        for slot in slots:
            self.release(slot)
        if self.rows.is_cuda:
            torch.cuda.synchronize(self.rows.device)

    def _clear(self, slot: int) -> None:
        self._adopted.pop(slot, None)
        self._read.pop(slot, None)
        self.mark.touch_slots((slot,))
        zero = self.rows.new_zeros(())
        self.rows[slot, EPOCH] = zero
        self.rows[slot, CHECK] = zero
        self._n_blocks.pop(slot, None)


def counted(entries: Seq[Entry]) -> tuple[list[Entry], list[Entry]]:
    """Invariant 8 (pure): each entry with its adoption counted, and apart those adopted MAX_ADOPTIONS times
    already without progress."""
    kept = [replace(e, adoptions=e.adoptions + 1) for e in entries if e.adoptions < MAX_ADOPTIONS]
    return kept, [e for e in entries if e.adoptions >= MAX_ADOPTIONS]
