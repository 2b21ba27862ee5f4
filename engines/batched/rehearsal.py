"""A prepared standby's rehearsal of a takeover, over scratch memory of its own, before it shadows anyone.

A prepared standby (__main__.py `prepare_runner`) holds a runner whose decode and mixed graphs are captured over its
reservations, and warm kernels of a scratch model (warmup.py). What neither runs is the rest of a successor's first
steps: the journal's reads and writes, an isolated takeover's block copies, the drain mark's stamps, a mixed step's
eager parts at the step budget. Under CUDA's lazy loading each such kernel is loaded on its first launch, every
first pass through Python code builds its caches then, and every first staging of a journal write pins host memory
(cudaHostAlloc): on the recovery's path, where an isolated successor runs while its predecessor's context is torn
down. Measured on an H100 (64 + 16 streams, 8b-class, fast mode, 2026-12-05,
docs/results/h100-rehearsal-2026-12-05): an isolated takeover's copies and rows ("apply") took over 19 ms in 10 of
25 unrehearsed isolated kills (20-29 ms), and 3-8 ms in all 6 rehearsed ones; the first decode and mixed steps, and
the largest gap end to end, did not move beyond the spread.

So the standby plays a takeover through once, with the very code a successor runs (`build`: __main__.py
`build_engine`, the one path), over scratch memory of its own (`scratch`): a small KV cache and journal of the
configuration's block size (its context: the longest prompt's and what it makes), beside the weights' placeholder
(its content is garbage: nothing read from it matters). Not over the reservations: their placeholder is one block of memory mapped again and again
(libs/client/mapping.py), so the cache's writes would land in the journal. Its runner is eager (the prepared
runner's graphs are bound to the reservations), so the eager kernels of a mixed step run at the step budget.
1. serve: an engine over the scratch memory (its journal formatted, a drain mark over a page of its own) takes `n`
   requests, prompts about the step budget in all, one of them over two prefill chunks, and runs until each has made
   `ahead` tokens; it is stopped there, its journal's rows left as a dead engine leaves them;
2. isolate: those rows recovered, and an isolated successor's moves for one of them (a slot and a block held back
   as pending: the block copied, every row written again in the next generation, isolation.py);
3. take over: an engine built over the same memory as handed on (`kv_handed_on`) recovers and adopts the rows,
   every request comes back as a router's replay does (a claim), and each makes `ahead` more tokens.
Then torch's pinned host allocator is given blocks of every size class a journal write stages through
(`warm_pinned`): pinning memory (cudaHostAlloc) on the recovery's path is a driver call like any other.

Invariants:
1. Nothing it writes is anyone else's: the scratch memory is allocated for it and dropped after.
2. It leaves nothing running: both engines' step threads are stopped (or it raises) and the drain pages unregistered.
3. A rehearsal that fails is said and costs only its warmth: the standby stands by as before (__main__.py).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from engines.batched import isolation
from engines.batched.cache_units import kv_shape
from engines.batched.drain import NO_MARK, DrainMark, PageLayout, Pending
from engines.batched.engine import LLMEngine
from engines.batched.journal import Journal, JournalLayout
from engines.batched.live import Request
from engines.batched.memory import Loaded
from engines.reference.config import ModelConfig
from libs.common.procs import ms_since

WAIT_S = 60.0  # an act that has not ended by then raises: a standby that cannot run its own steps is not ready
AHEAD = 3  # tokens each request makes in each act (4 * AHEAD at most in all)


class _Sink:
    """One request's tokens; `want` of them (or its end) sets the shared countdown once."""

    def __init__(self, want: int, left: list[int], done: threading.Event, lock: threading.Lock) -> None:
        self.tokens: list[int] = []
        self.reason: str | None = None
        self._want, self._left, self._done, self._lock, self._counted = want, left, done, lock, False

    def token(self, token: int) -> None:
        self.tokens.append(token)
        if len(self.tokens) >= self._want:
            self._count()

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.reason = reason
        self._count()

    def _count(self) -> None:
        with self._lock:
            if self._counted:
                return
            self._counted = True
            self._left[0] -= 1
            if self._left[0] <= 0:
                self._done.set()


def _sinks(n: int, want: int) -> tuple[list[_Sink], threading.Event]:
    done, lock, left = threading.Event(), threading.Lock(), [n]
    return [_Sink(want, left, done, lock) for _ in range(n)], done


def _run(engine: LLMEngine, requests: list[Request], done: threading.Event, act: str) -> None:
    engine.start()
    try:
        for req in requests:
            engine.submit(req)
        if not done.wait(WAIT_S):
            raise TimeoutError(f"the rehearsal's {act} did not end within {WAIT_S:.0f} s")
    finally:
        if not engine.stop():
            raise RuntimeError(f"the rehearsal's {act}: its step thread did not end")
    if engine.fatal is not None:
        raise RuntimeError(f"the rehearsal's {act} failed: {engine.fatal!r}") from engine.fatal


def prompts(n: int, *, vocab: int, budget: int, chunk: int, max_len: int, ahead: int = AHEAD,
            seed: int = 0) -> list[list[int]]:
    """`n` prompts of random tokens: together about the step budget, the first one over two prefill chunks (so that
    a prefill is cut into chunks); each leaves room in `max_len` for what it generates (4 * `ahead`)."""
    rng = random.Random(seed)
    room = max(1, max_len - 4 * ahead - 1)
    lengths = [max(1, min(room, budget // n))] * n
    lengths[0] = max(1, min(room, 2 * chunk + 3))
    return [[rng.randrange(1, vocab) for _ in range(k)] for k in lengths]


def scratch(like: Loaded, mcfg: ModelConfig, texts: list[list[int]], ahead: int = AHEAD) -> Loaded:
    """A cache and journal of `like`'s block size, just large enough for `texts` and what they generate (and a free
    slot and block for each to move to), beside `like`'s weights: the rehearsal's memory. Its context is the longest
    text's and what it generates, not the configuration's: a scheduler refuses a cache that cannot hold one sequence
    of its context, and one of a 128k context would be gigabytes beside a serving engine."""
    bs = like.layout.block_size
    max_len = -(-(max(len(t) for t in texts) + 4 * ahead + 1) // bs) * bs
    blocks = max(sum(-(-(len(t) + 4 * ahead + 1) // bs) + 1 for t in texts), max_len // bs + 1)
    layout = JournalLayout(block_size=bs, num_blocks=blocks, slots=len(texts) + 1, max_len=max_len)
    dev = like.kv.device
    kv = torch.zeros(kv_shape(mcfg, blocks, bs), dtype=like.kv.dtype, device=dev)
    journal = {n: torch.zeros(shape, dtype=dt, device=dev) for n, (dt, shape) in layout.tensors().items()}
    return Loaded(like.weights, kv, journal, "rehearsal", False, layout, {}, like.fused)


def warm_pinned(largest: int = 8 << 20, each: int = 4) -> int:
    """Pinned host blocks in torch's host allocator, `each` of every power of two from 4 KiB to `largest` bytes (half
    as many past 1 MiB), allocated and given back to its cache: a journal write's staging (journal.py `_on`) then
    finds one instead of pinning new memory (cudaHostAlloc) on the recovery's path. Returns the bytes pinned."""
    blocks = [torch.empty(1 << k, dtype=torch.uint8).pin_memory() for k in range(12, largest.bit_length())
              for _ in range(each if 1 << k <= 1 << 20 else max(1, each // 2))]
    return sum(b.numel() for b in blocks)


def rehearse(build: Callable[..., tuple[LLMEngine, dict[str, Any]]], mem: Loaded, texts: list[list[int]], *,
             ahead: int = AHEAD) -> dict[str, Any]:
    """The three acts (module doc) over `mem` (`scratch`), one request a prompt of `texts`; `build(loaded, mark=,
    pend=)` makes an engine over `loaded` (and its adoption's info). What each act took, recovered, adopted."""
    layout = mem.layout
    n = len(texts)
    pages = PageLayout(layout.slots, layout.num_blocks)
    t0 = time.perf_counter()
    marks: list[DrainMark] = []  # each engine's own, as each engine opens its own (drain.py: on CUDA only)

    def new_mark(gen: int) -> DrainMark | None:
        if mem.kv.device.type != "cuda":
            return None
        marks.append(DrainMark(torch.zeros(pages.numel, dtype=torch.int64), mem.kv.device, pages, gen))
        return marks[-1]

    try:
        # act 1: serve, and stop mid-generation
        sinks, done = _sinks(n, ahead)
        reqs = [Request(f"rehearsal-{i}", list(p), 4 * ahead, 0.0, 0, True, sinks[i]) for i, p in enumerate(texts)]
        engine, _ = build(mem, mark=new_mark(0), pend=None)
        _run(engine, reqs, done, "serve")
        t_serve = ms_since(t0)
        # act 2: the rows as a successor reads them, and an isolated successor's moves for one of them
        t1 = time.perf_counter()
        copied = 0
        journal = Journal(layout, mem.journal)
        entries, _ = journal.recover()
        bs = layout.block_size
        # one row's slot and the block its next position is in, held back as pending: a block that holds positions
        # the row keeps is copied (isolation.py rule 2), the row moved to the free slot
        e = next((e for e in entries if e.computed % bs and e.computed // bs < len(e.block_table)), None)
        if e is not None:
            held = e.block_table[e.computed // bs]
            pend = Pending(drained=False, header=False, slots=frozenset({e.slot}), blocks=frozenset({held}))
            p = isolation.plan(entries, pend, free_slots=journal.free_slot_ids(), num_blocks=layout.num_blocks,
                               block_size=bs)
            isolation.apply(p, mem.kv, journal, journal.gen + 1, marks[-1] if marks else NO_MARK)
            copied = len(p.copies)
        t_isolate = ms_since(t1)
        # act 3: a successor over the same memory adopts the rows; every request resumes
        t2 = time.perf_counter()
        again, resumed = _sinks(n, ahead)
        successor, adopted = build(dataclasses.replace(mem, kv_handed_on=True),
                                   mark=new_mark(journal.generation() or 0), pend=None)
        replays = [Request(r.request_id, r.context + s.tokens, r.max_tokens - len(s.tokens), 0.0, 0, True, again[i],
                           resumed=len(s.tokens)) for i, (r, s) in enumerate(zip(reqs, sinks, strict=True))]
        _run(successor, replays, resumed, "takeover")
        pinned = 0
        if mem.kv.device.type == "cuda":
            torch.cuda.synchronize(mem.kv.device)
            pinned = warm_pinned()
        return {"ms": ms_since(t0), "serve_ms": t_serve, "isolate_ms": t_isolate, "takeover_ms": ms_since(t2),
                "cache_blocks": layout.num_blocks, "context": layout.max_len, "recovered": len(entries),
                "copied": copied, "adopted": adopted.get("adopted", 0), "claimed": successor.counters.claimed,
                "tokens": sum(len(s.tokens) for s in sinks + again), "pinned_bytes": pinned}
    finally:
        for m in marks:
            m.stop()
