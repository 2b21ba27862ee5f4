"""The KV cache across a takeover: an engine marks which positions of each slot hold finished keys and values
of which tokens, and a successor that maps its predecessor's cache copies a resumed request's finished prefix
instead of computing it again (DESIGN.md section 3: per-request KV is reused only where the engine marked it
consistent). Why: a request resumed after a failover otherwise runs one forward per token it had generated
(engine.py invariant 1): 500 tokens at 45 ms a forward (a 120 GiB model on an H200) are 22 s before it moves on.

Marks: an int64 tensor [slot, 1 + max_seq] in the KV lease, beside the cache. Column 0: the prompt length of the
slot's request (the part prefilled in chunks); column 1 + p: the token at position p once the forward that wrote
p's keys and values in every layer has ended; -(token + 2) for a token sampled for position p and sent, its
forward not run yet (the generation is in flight: continuation.py); else -1.

Invariants:
1. A mark is written after the forward whose keys and values it vouches for, on the same stream (kernels run in
   order), and a slot's marks are cleared before its next request's first forward: whatever state a killed
   engine stopped in, a mark vouches for finished keys and values.
2. Reuse is exact: a prefix is reused only if the slot's prompt length equals the request's and every token
   matches, so its keys and values came from the same forwards (the same chunks at the same positions) an
   uninterrupted run makes; the rest of the context then runs as it would have, one token at a time. It covers
   the whole prompt or nothing.
3. A predecessor still alive (a hang) may rewrite a slot while it is read: the marks are read again after the
   copy, and the copy is used only if they still vouch for it (equal marks rewritten mean equal keys and values).
4. The context's last token is always computed again: its logits give the next token.
5. Where the KV lease itself is handed on (a reattach, a cold-spawned takeover: `InheritedSlots`), a slot whose
   marks vouch for a prompt is given to no request but one whose context they cover, until it is needed or the
   window ends: its keys and values stay as the predecessor left them, and the request continues in place.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

log = logging.getLogger("holdfast.engine.kv_reuse")

UNMARKED = -1


def sampled_mark(token: int) -> int:
    return -(token + 2)


def in_flight(row: torch.Tensor) -> tuple[list[int], int] | None:
    """The generation in flight in the slot whose marks are `row` (a CPU tensor): its context (every finished
    position, then the token sampled after them) and its prompt length; None if the slot holds none."""
    prompt_len = int(row[0])
    if prompt_len <= 0:
        return None
    unfinished = (row[1:] < 0).nonzero()
    if unfinished.numel() == 0:
        return None
    n = int(unfinished[0])
    nxt = int(row[1 + n])
    if n < prompt_len or nxt > sampled_mark(0):
        return None
    return [*row[1:1 + n].tolist(), -nxt - 2], prompt_len


def marks_shape(slots: int, max_seq: int) -> tuple[int, int]:
    return (slots, 1 + max_seq)


def reusable_prefix(row: torch.Tensor, prompt_len: int, ctx: Sequence[int]) -> int:
    """How many leading positions of `ctx` the slot whose marks are `row` (a CPU tensor) holds finished: 0
    unless they cover the whole prompt (`prompt_len` tokens); never the last position (invariant 4)."""
    if prompt_len <= 0 or int(row[0]) != prompt_len:
        return 0
    limit = min(len(ctx) - 1, row.shape[0] - 1)
    if limit < prompt_len:
        return 0
    same = row[1:1 + limit] == torch.tensor(ctx[:limit], dtype=row.dtype)
    m = limit if bool(same.all()) else int(torch.argmin(same.to(torch.int8)))
    return m if m >= prompt_len else 0


class SlotMarks:
    """The writer's side: one engine's marks over its own cache (invariant 1). A slot's marks are written by the
    thread serving its request, in stream order with that request's forwards (a prefix copied in: on the
    donor's stream, which the next forward waits for)."""

    def __init__(self, marks: torch.Tensor, keep: Sequence[int] = ()) -> None:
        self.marks = marks
        # whatever a previous owner left vouches for nothing in this engine's cache, but in the slots it inherits
        # (invariant 5), whose keys and values are kept as they are
        for slot in range(marks.shape[0]):
            if slot not in keep:
                marks[slot].fill_(UNMARKED)

    def begin(self, slot: int, prompt_len: int) -> None:
        row = self.marks[slot]
        row.fill_(UNMARKED)
        row[0].fill_(prompt_len)

    def vouch(self, slot: int, marks: torch.Tensor) -> None:
        """A prefix copied from a predecessor's cache (KvDonor.restore), with the marks that vouched for it."""
        self.marks[slot, :marks.shape[0]].copy_(marks)

    def sampled(self, slot: int, position: int, token: int) -> None:
        """`token` was sampled for `position` and goes to the client; its forward comes with the next step."""
        self.marks[slot, 1 + position].fill_(sampled_mark(token))

    def unsampled(self, slot: int, position: int) -> None:
        """The generation ended without feeding its last sampled token: nothing is in flight in the slot."""
        self.marks[slot, 1 + position].fill_(UNMARKED)

    def written(self, slot: int, start: int, tokens: torch.Tensor) -> None:
        """`tokens` (a device tensor, int64) now have finished keys and values at positions start.."""
        self.marks[slot, 1 + start:1 + start + tokens.shape[0]].copy_(tokens)

    @contextlib.contextmanager
    def overwritten(self, slot: int, positions: torch.Tensor) -> Iterator[None]:
        """`positions` (a device tensor) of the slot hold other keys and values for a while and are put back
        after (a graph capture's warm-up): they vouch for nothing meanwhile, then as before."""
        row = self.marks[slot]
        saved = row.index_select(0, positions + 1)
        row.index_fill_(0, positions + 1, UNMARKED)
        yield
        row.index_copy_(0, positions + 1, saved)


class KvDonor:
    """A predecessor's cache and marks, mapped read-only by its successor: the prefixes of its requests, to be
    copied into the successor's own slots. `on_retire` gives the memory back once the donor is no longer read."""

    def __init__(self, kv: torch.Tensor, marks: torch.Tensor, on_retire: Callable[[], None] | None = None) -> None:
        self.kv, self.marks = kv, marks
        self.side = torch.cuda.Stream(kv.device) if kv.is_cuda else None  # reads not queued behind our forwards
        # The second read's buffer, made now: a device allocation on the takeover's path waits for the driver,
        # which the predecessor's teardown holds for tens of ms (scripts/probe_teardown.py).
        self._again = torch.empty(marks.shape[1], dtype=marks.dtype, device=marks.device)
        self._on_retire = on_retire
        self.requests = 0
        self.positions = 0
        self.refused = 0  # prefixes the marks vouched for, then not (a live predecessor rewrote them)

    def warm(self) -> None:
        """Run the stream and its copies once (the shadow does, long before its promotion)."""
        with self._stream():
            self._again.copy_(self.marks[0])
            self._again.to("cpu")

    def fits(self, kv: torch.Tensor) -> bool:
        """Whether this cache's slots have `kv`'s layout (layers, k|v, heads, head_dim, dtype)."""
        a, b = self.kv.shape, kv.shape
        return a[1:4] == b[1:4] and a[5] == b[5] and self.kv.dtype == kv.dtype

    @contextlib.contextmanager
    def _stream(self) -> Iterator[None]:
        if self.side is None:
            yield
            return
        with torch.cuda.stream(self.side):
            yield
        torch.cuda.current_stream(self.kv.device).wait_stream(self.side)

    def restore(self, into_kv: torch.Tensor, into_marks: SlotMarks | None, slot: int, prompt_len: int,
                ctx: Sequence[int]) -> int:
        """Copy the longest prefix of `ctx` this cache holds finished into slot `slot` of `into_kv`, and mark it
        there (a new request's marks, then the prefix's: this engine's successor may reuse it in turn); returns
        its length (0: nothing reused, nothing marked). The forward lock is held: the slot is the caller's, and
        none of its forwards is in flight (each ended in a sampled token). Everything runs on a stream of its
        own, not queued behind other requests' forwards, and allocates nothing on the device."""
        with self._stream():
            rows = self._snapshot()
            best, m = 0, 0
            for s in range(rows.shape[0]):
                got = reusable_prefix(rows[s], prompt_len, ctx)
                if got > m:
                    best, m = s, got
            if m == 0:
                return 0
            into_kv[slot, :, :, :, :m].copy_(self.kv[best, :, :, :, :m])
            vouched = self._read_again(best, m)
            if not torch.equal(vouched.to("cpu"), rows[best, :1 + m]):  # invariant 3: the copy may be torn
                self.refused += 1
                return 0
            if into_marks is not None:
                into_marks.begin(slot, prompt_len)
                into_marks.vouch(slot, vouched)
        self.requests += 1
        self.positions += m
        return m

    def in_flight(self) -> list[tuple[list[int], int]]:
        """The generations in flight in the predecessor's slots: (context, prompt length) each."""
        with self._stream():
            rows = self._snapshot()
        return [got for s in range(rows.shape[0]) if (got := in_flight(rows[s])) is not None]

    def _snapshot(self) -> torch.Tensor:
        """Every slot's marks, on the CPU (a copy: on a CPU, `to` would hand back the live memory itself)."""
        return self.marks.to("cpu", copy=True)

    def _read_again(self, slot: int, m: int) -> torch.Tensor:
        """The slot's marks of the first `m` positions, read again after their copy (invariant 3), on the device."""
        return self._again[:1 + m].copy_(self.marks[slot, :1 + m])

    def stats(self) -> dict[str, int]:
        return {"requests": self.requests, "positions": self.positions, "refused": self.refused}

    def retire(self) -> None:
        """No more reads: every copy has ended, then the memory goes back (the caller drops this object)."""
        if self.side is not None:
            self.side.synchronize()
        del self.kv, self.marks
        if self._on_retire is not None:
            self._on_retire()


def holds_a_prompt(row: torch.Tensor) -> bool:
    """Whether the slot whose marks are `row` (a CPU tensor) holds a whole prompt's finished keys and values."""
    prompt_len = int(row[0])
    return 0 < prompt_len < row.shape[0] and bool((row[1:1 + prompt_len] >= 0).all())


class InheritedSlots:
    """This engine's own cache as its predecessor left it (invariant 5): on the reattach and cold-spawned takeover
    paths the KV lease is handed on, not shared, so a resumed request needs no copy: it is served in the slot that
    holds its prefix. Those slots are held out of other requests' way until one claims them, a request finds no
    other slot (`evict`), or the window ends (`release_all`)."""

    def __init__(self, rows: torch.Tensor) -> None:
        """`rows`: every slot's marks as the predecessor left them, on the CPU (read before they are cleared)."""
        self._lock = threading.Lock()
        self._rows = {s: rows[s].clone() for s in range(rows.shape[0]) if holds_a_prompt(rows[s])}
        self.requests = 0
        self.positions = 0

    @property
    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._rows)

    def claim(self, prompt_len: int, ctx: Sequence[int]) -> tuple[int, torch.Tensor] | None:
        """The held slot that holds the longest finished prefix of `ctx`, no longer held, and its marks of that
        prefix (the prompt length, then the prefix's tokens: SlotMarks.vouch); None if no held slot holds one."""
        with self._lock:
            best, m = -1, 0
            for slot, row in self._rows.items():
                got = reusable_prefix(row, prompt_len, ctx)
                if got > m:
                    best, m = slot, got
            if m == 0:
                return None
            row = self._rows.pop(best)
            self.requests += 1
            self.positions += m
            return best, row[:1 + m]

    def in_flight(self) -> list[tuple[list[int], int]]:
        """The generations in flight in the held slots: (context, prompt length) each."""
        with self._lock:
            rows = list(self._rows.values())
        return [got for row in rows if (got := in_flight(row)) is not None]

    def evict(self) -> int | None:
        """A held slot, its contents given up (a request needs it), or None."""
        with self._lock:
            return self._rows.popitem()[0] if self._rows else None

    def release_all(self) -> list[int]:
        """Every slot still held: the requests a failover replays have had their window."""
        with self._lock:
            slots = list(self._rows)
            self._rows.clear()
            return slots

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"requests": self.requests, "positions": self.positions, "refused": 0, "held": len(self._rows)}


def retire_later(after_s: float, retire: Callable[[], None]) -> threading.Timer:
    """`retire()` once the requests a failover replays have had `after_s` to come back."""
    t = threading.Timer(after_s, retire)
    t.name, t.daemon = "kv-donor-retire", True
    t.start()
    return t
