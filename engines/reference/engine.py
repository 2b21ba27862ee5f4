"""The engine core: requests in, tokens out. No transport code (HTTP lives in server.py, memory in memory.py).

Each request holds one slot of the KV cache while it runs; forwards are serialized by a lock (one batch of
one: the reference engine values exactness over throughput). Invariants:
1. Exact resume: a request's prompt (`context[:prefix_len]`) is prefilled in chunks of `prefill_chunk`
   starting at position 0, and the rest of the context (tokens already generated, handed back by a router
   resuming the request) one token at a time. So resuming from `prompt + generated[:k]` runs exactly the
   forwards the uninterrupted generation ran (same shapes at the same positions) and continues as it did,
   while a fresh prompt still gets a fast chunked prefill.
2. Sampling draws from a generator seeded by (seed, absolute position): a sampled generation is
   resumable the same way; temperature 0 is greedy (argmax, lowest index on a tie).
3. A slot is returned when its generation ends, fails or is abandoned (`close()` of the iterator), never with
   a forward in flight (each forward ends in a sampled token before the generation can stop).
4. Where the cache is leased, each slot's finished positions are marked (kv_reuse.py), and a successor holding
   its predecessor's cache (`donor`) copies a resumed request's finished prefix instead of computing it: the
   forwards run are those of invariant 1 from there on, so the continuation is the same. The generations the
   predecessor had in flight are continued before their requests come back (continuation.py). Where the KV lease
   itself was handed on (`inherit`: a reattach, a cold-spawned takeover), the slots holding a predecessor's
   prompts wait for their requests, which continue in place (kv_reuse.py invariant 5).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engines.reference.continuation import Continuations, key_of
from engines.reference.kv_reuse import InheritedSlots, KvDonor, SlotMarks
from engines.reference.model import Transformer
from engines.reference.static_forward import StaticForward
from libs.common import gc_tuning
from libs.common.generate import SAMPLING_EPS
from libs.common.tokenizer import EOS, TextStream

log = logging.getLogger("holdfast.engine")


@dataclass(frozen=True)
class GenerationRequest:
    context: list[int]
    max_tokens: int
    prefix_len: int | None = None  # the prompt part of `context` (None: all of it); the rest is a resume
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    ended: bool = False  # the generation ended already: its resume ends at EOS (libs/common/generate.py `ended`)


@dataclass(frozen=True)
class TokenOut:
    index: int
    token: int
    text: str


@dataclass(frozen=True)
class Finished:
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "length", "eos" or "max_seq"
    first_token_ms: float
    total_ms: float
    text: str = ""  # the text of bytes its last tokens left unfinished (TextStream.flush)


class BadRequest(ValueError):
    pass


def sample(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """One token from the last row of `logits`; depends only on (logits, temperature, seed, position)."""
    row = logits[-1].float()
    if temperature < SAMPLING_EPS:
        return int(torch.argmax(row).item())
    probs = torch.softmax(row.cpu() / temperature, dim=-1)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + position) % (2**63))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def prompt_length(n: int, prefix_len: int | None) -> int:
    return n if prefix_len is None else max(0, min(prefix_len, n))


def prefill_spans(n: int, prefix_len: int | None, chunk: int, reused: int = 0) -> list[tuple[int, int]]:
    """[start, stop) of each prefill forward: the prompt in chunks from 0, then the resumed tokens singly; with
    `reused` positions copied from a predecessor's cache (at least the whole prompt), only the tokens after."""
    prefix = prompt_length(n, prefix_len)
    if reused:
        return [(i, i + 1) for i in range(max(reused, prefix), n)]
    spans = [(i, min(i + chunk, prefix)) for i in range(0, prefix, chunk)]
    return spans + [(i, i + 1) for i in range(prefix, n)]


class EngineCore:
    def __init__(self, model: Transformer, kv: torch.Tensor, *, prefill_chunk: int = 64,
                 graphs: bool | None = False, marks: torch.Tensor | None = None, donor: KvDonor | None = None,
                 inherit: bool = False) -> None:
        if kv.dim() != 6 or kv.shape[1] != model.cfg.n_layers:
            raise ValueError(f"kv cache shape {tuple(kv.shape)} does not fit {model.cfg.n_layers} layers")
        self.model = model
        self.kv = kv
        self.prefill_chunk = max(1, prefill_chunk)
        # invariant 4 (leased caches only); a cache handed on keeps the slots its predecessor's requests are in
        self.inherited = InheritedSlots(marks.to("cpu", copy=True)) if marks is not None and inherit else None
        held = self.inherited.held if self.inherited is not None else []
        self.marks = SlotMarks(marks, keep=held) if marks is not None else None
        self.donor = donor if donor is not None and donor.fits(kv) else None
        if self.donor is not None:
            self.donor.warm()
        self.donor_stats: dict[str, int] | None = None  # what the retired donor served
        # fixed-shape forwards (CUDA graphs once captured by warm()): static_forward.py; None: where it pays, on CUDA
        if graphs is None:
            graphs = model.device.type == "cuda"
        self.static = (StaticForward(model, kv, min(self.prefill_chunk, kv.shape[4]), self.marks, keep=held)
                       if graphs else None)
        self.max_seq = kv.shape[4]
        self._lock = threading.Lock()  # one forward at a time
        self._free = [slot for slot in range(kv.shape[0]) if slot not in held]
        self._slots_cv = threading.Condition()
        self.continuations = Continuations()
        self.tokens_generated = 0
        self.requests_done = 0
        self._phases: dict[str, float] | None = None  # armed by trace_next(): where one generation's time goes
        self._phases_t0 = 0.0

    @property
    def slots(self) -> int:
        return int(self.kv.shape[0])

    def free_slots(self) -> int:
        with self._slots_cv:
            return len(self._free)

    def _take_slot(self, timeout: float | None) -> int:
        with self._slots_cv:
            if not self._free:
                evicted = self.continuations.evict()  # continuation.py invariant 2
                if evicted is None and self.inherited is not None:
                    evicted = self.inherited.evict()
                if evicted is not None:
                    return evicted
            if not self._slots_cv.wait_for(lambda: bool(self._free), timeout=timeout):
                raise TimeoutError("no free KV slot")
            return self._free.pop()

    def _try_take_slot(self, keep_free: int) -> int | None:
        with self._slots_cv:
            return self._free.pop() if len(self._free) > keep_free else None

    def _give_slot(self, slot: int) -> None:
        with self._slots_cv:
            self._free.append(slot)
            self._slots_cv.notify()

    @contextlib.contextmanager
    def spare_slot(self) -> Iterator[int]:
        """A slot for a forward of the engine's own (a probe, a warm-up), given back after."""
        slot = self._take_slot(None)
        try:
            yield slot
        finally:
            self._give_slot(slot)

    def forward(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        with self._lock:
            return self._forward(slot, tokens, start)

    def _forward(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        """One forward, the lock held: fixed-shape (static_forward.py invariant 1) for one token and for a
        prompt's first chunk when graphs are on; eager otherwise."""
        static, marks = self.static, self.marks
        if static is not None and (len(tokens) == 1 or start == 0 and len(tokens) <= static.chunk):
            if len(tokens) == 1:
                logits = static.decode(slot, tokens[0], start)
                written = static.token
            else:
                logits = static.first_chunk(slot, tokens)
                written = static.prompt[:len(tokens)]
        else:
            written = torch.tensor(tokens, dtype=torch.long, device=self.model.device)
            logits = self.model.forward(written, start, self.kv[slot])
        if marks is not None:
            marks.written(slot, start, written)
        return logits

    def prefill(self, slot: int, ctx: list[int], prefix_len: int | None,
                inherited: torch.Tensor | None = None) -> tuple[torch.Tensor | None, int]:
        """All of a request's prefill forwards under one hold of the lock: when many requests arrive at
        once (a failover releases the held and the replayed ones together), the first of them reaches its
        first token after its own prefill rather than after everyone's forwards interleaved. Returns the
        last logits and how many positions came from the predecessor's cache (invariant 4). `inherited`: the
        marks of the prefix `slot` holds already (InheritedSlots.claim)."""
        logits = None
        prompt = prompt_length(len(ctx), prefix_len)
        with self._lock:
            reused = 0
            if inherited is not None and self.marks is not None:
                reused = inherited.shape[0] - 1
                self.marks.begin(slot, prompt)  # the rest of the old generation's marks vouch for nothing now
                self.marks.vouch(slot, inherited)
            elif self.donor is not None and prompt < len(ctx):
                reused = self.donor.restore(self.kv, self.marks, slot, prompt, ctx)  # marks the slot if it reuses
            if self.marks is not None and not reused:
                self.marks.begin(slot, prompt)
            for start, stop in prefill_spans(len(ctx), prefix_len, self.prefill_chunk, reused):
                logits = self._forward(slot, ctx[start:stop], start)
        return logits, reused

    def retire_donor(self) -> None:
        """Stop reading the predecessor's cache (the replayed requests have come back), and give it back; slots
        still held for them are free again."""
        with self._lock:  # no copy from it runs now, and none starts after
            donor = self.donor
            if donor is not None:
                self.donor_stats = donor.stats()
            self.donor = None
        held = self.inherited.release_all() if self.inherited is not None else []
        for slot in self.continuations.drop_all() + held:
            self._give_slot(slot)
        if donor is not None:
            donor.retire()

    def continue_in_flight(self) -> int:
        """Run now the forward that resumes each generation the predecessor had in flight (continuation.py),
        keeping one slot free for new requests (an inherited one continues in its own slot); returns how many
        were computed."""
        donor, inherited = self.donor, self.inherited
        if donor is not None:
            found = donor.in_flight()[:max(0, self.slots - 1)]
        elif inherited is not None:
            found = inherited.in_flight()
        else:
            return 0
        todo = [key_of(ctx, prompt) for ctx, prompt in found]
        self.continuations.plan(todo)  # before any claim: a request coming back meanwhile waits for its forward
        done = 0
        for key in todo:
            ctx, prompt = list(key[0]), key[1]
            held: torch.Tensor | None = None  # the marks of the prefix an inherited slot holds
            if donor is not None:
                slot = self._try_take_slot(keep_free=1)
            else:
                assert inherited is not None
                claimed = inherited.claim(prompt, ctx)
                slot, held = claimed if claimed is not None else (None, None)
            if slot is None:
                self.continuations.abandon(key)
                continue
            try:
                logits, reused = self.prefill(slot, ctx, prompt, held)
            except BaseException:
                self.continuations.abandon(key)
                self._give_slot(slot)
                raise
            self.continuations.done(key, slot, logits, reused)  # type: ignore[arg-type]
            done += 1
        return done

    def continue_in_background(self, into: dict[str, Any], **note: Any) -> threading.Thread:
        """continue_in_flight on a thread of its own; what it did (generations, ms, and `note`) goes to `into`
        (/health `continued`). A failure costs only time: the requests compute the same forwards themselves."""
        def run() -> None:
            t0 = time.perf_counter()
            try:
                into.update(generations=self.continue_in_flight(), ms=round((time.perf_counter() - t0) * 1000, 3),
                            **note)
            except Exception as e:  # noqa: BLE001 - see above
                log.warning("continuing the predecessor's generations failed: %s: %s", type(e).__name__, e)

        t = threading.Thread(target=run, name="continue-in-flight", daemon=True)
        t.start()
        return t

    def kv_reuse(self) -> dict[str, int] | None:
        """Prefixes copied from a predecessor's cache so far, and in-flight generations continued (None: this
        engine had no predecessor's cache)."""
        donor, inherited = self.donor, self.inherited
        stats = donor.stats() if donor is not None else inherited.stats() if inherited is not None else self.donor_stats
        return {**stats, **self.continuations.stats()} if stats is not None else None

    def trace_next(self, into: dict[str, float], t0: float) -> None:
        """Record, into `into`, the phases of the next generation (ms since `t0`): slot taken, prefill
        launched (a launch stalls on a kernel module loaded lazily or a block the allocator must get from the
        driver), first token sampled (waits for the GPU), the allocator's new segments and the garbage
        collector's pauses meanwhile. Why:
        a successor's first token is the recovery's largest remaining step; this says what it waited on."""
        self._phases_t0 = t0
        self._phases = into
        gc_tuning.count_pauses()

    def mark(self, name: str) -> None:
        """A phase on the way to the armed generation (the HTTP layer's steps before it starts); the first
        request to pass a step records it."""
        phases = self._phases
        if phases is not None and name not in phases:
            self._mark(phases, name)

    def _mark(self, phases: dict[str, float] | None, name: str) -> None:
        if phases is not None:
            phases[name] = round((time.perf_counter() - self._phases_t0) * 1000, 3)

    def _segments(self) -> int:
        if self.model.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.model.device).get("segment.all.allocated", 0))

    def validate(self, req: GenerationRequest) -> None:
        if not req.context:
            raise BadRequest("empty context: give a prompt or tokens")
        if any(t < 0 or t >= self.model.cfg.vocab_size for t in req.context):
            raise BadRequest(f"token ids must be in [0, {self.model.cfg.vocab_size})")
        if len(req.context) >= self.max_seq:
            raise BadRequest(f"context of {len(req.context)} tokens does not fit max_seq {self.max_seq}")
        if req.max_tokens < 0:
            raise BadRequest("max_tokens must be >= 0")

    def generate(self, req: GenerationRequest, *,
                 slot_timeout: float | None = None) -> Generator[TokenOut | Finished, None, None]:
        """Yields TokenOut per generated token, then one Finished. Each next() runs at most one forward
        pass, so a caller can step it from a worker thread and stop at any point (close() frees the slot)."""
        self.validate(req)
        t0 = time.perf_counter()
        phases, self._phases = self._phases, None
        segments = self._segments() if phases is not None else 0
        gc_before = gc_tuning.paused_ms() if phases is not None else 0.0
        self._mark(phases, "called")
        ctx = list(req.context)
        continued = claimed = None
        if req.max_tokens > 0:
            prompt = prompt_length(len(ctx), req.prefix_len)
            continued = self.continuations.take(key_of(ctx, prompt), slot_timeout)
            if continued is None and self.inherited is not None:
                claimed = self.inherited.claim(prompt, ctx)
        slot = continued[0] if continued is not None else claimed[0] if claimed is not None else \
            self._take_slot(slot_timeout)
        self._mark(phases, "slot")
        unfed: int | None = None  # the position of a token sampled and not fed yet (kv_reuse.py marks)
        try:
            text = TextStream()
            text.prime(req.context)
            logits = None
            if continued is not None:
                _, logits, reused = continued
                self._mark(phases, "continued")
            elif req.max_tokens > 0 and not req.ended:
                logits, reused = self.prefill(slot, ctx, req.prefix_len, claimed[1] if claimed is not None else None)
                self._mark(phases, "prefill_launched")
            if phases is not None and logits is not None:
                phases["kv_reused"] = reused
            first_ms = 0.0
            produced = 0
            reason = "eos" if req.ended else "length"
            while produced < req.max_tokens and not req.ended:
                if len(ctx) >= self.max_seq:
                    reason = "max_seq"
                    break
                assert logits is not None
                tok = sample(logits, req.temperature, req.seed, len(ctx))
                if produced == 0:
                    first_ms = (time.perf_counter() - t0) * 1000
                    self._mark(phases, "first_sampled")
                    if phases is not None:
                        phases["new_segments"] = self._segments() - segments
                        phases["gc_ms"] = round(gc_tuning.paused_ms() - gc_before, 3)  # collector pauses meanwhile
                        phases["prefill_tokens"] = len(ctx)
                if self.marks is not None:
                    self.marks.sampled(slot, len(ctx), tok)
                    unfed = len(ctx)
                ctx.append(tok)
                produced += 1
                self.tokens_generated += 1
                yield TokenOut(index=produced - 1, token=tok, text=text.push(tok))
                if tok == EOS and not req.ignore_eos:
                    reason = "eos"
                    break
                if produced < req.max_tokens and len(ctx) < self.max_seq:
                    logits = self.forward(slot, [tok], len(ctx) - 1)
                    unfed = None
            self.requests_done += 1
            yield Finished(prompt_tokens=len(req.context), completion_tokens=produced, finish_reason=reason,
                           first_token_ms=round(first_ms, 3), total_ms=round((time.perf_counter() - t0) * 1000, 3),
                           text=text.flush())
        finally:
            if unfed is not None and self.marks is not None:  # ended (or was abandoned): nothing in flight here
                self.marks.unsampled(slot, unfed)
            self._give_slot(slot)

    def warm_concurrent(self, n: int, *, cuda_only: bool = True) -> None:
        """Serve small generations from `n` threads at once, as the first requests after a takeover will be
        (CUDA only): prompts of every short length, resumed tokens, greedy and sampled, every slot busy.

        Why: right after a takeover the predecessor's CUDA context is still being torn down (~100 ms on an
        H200) and holds the driver lock that device allocations need, while kernels on memory already
        allocated run unhindered (scripts/probe_teardown.py, docs/benchmarks.md). Whatever the first
        requests would allocate must be allocated before: cuBLAS handles and workspaces (PyTorch keeps them
        per thread and hands a finished thread's to the next new one) and the caching allocator's blocks
        for the peak of concurrent requests."""
        if cuda_only and self.model.device.type != "cuda" or n < 1:
            return
        counters = (self.tokens_generated, self.requests_done)
        barrier = threading.Barrier(n)
        errors: list[BaseException] = []
        span = max(2, min(self.prefill_chunk, self.max_seq // 4))

        def one(i: int) -> None:
            try:
                # prompts of many lengths (each a new matmul shape: short prompts are the common case), then
                # 2 resumed tokens (a replay) and decode steps
                for length in (span, *range(2 + i, min(span, 18), n)):
                    context = [3 + (i + k) % 50 for k in range(length + 2)]
                    req = GenerationRequest(context=context, max_tokens=3, prefix_len=length,
                                            temperature=0.7 if i % 2 else 0.0, seed=i, ignore_eos=True)
                    for _ in self.generate(req, slot_timeout=60):
                        pass
                if self.model.device.type == "cuda":
                    torch.cuda.synchronize(self.model.device)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                errors.append(e)
            finally:
                barrier.wait()  # every thread holds its handles until all have run

        threads = [threading.Thread(target=one, args=(i,), name=f"warm-{i}", daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.tokens_generated, self.requests_done = counters
        if errors:
            raise errors[0]

    def capture_graphs_in_background(self) -> threading.Thread | None:
        """An engine serving already (recovered from attached memory: no warm-up on its recovery path) records
        its graphs between forwards; until then the same fixed-shape forwards run eagerly (the same numbers)."""
        if self.static is None or self.model.device.type != "cuda":
            return None
        static = self.static
        t = threading.Thread(target=lambda: static.capture(self.slots, self._lock), name="graph-capture", daemon=True)
        t.start()
        return t

    def warm(self) -> float:
        """Run the kernels once (one prefill chunk, one decode step); returns the milliseconds it took."""
        t0 = time.perf_counter()
        with self.spare_slot() as slot:
            n = max(2, min(self.prefill_chunk, self.max_seq - 2))  # a full chunk: its kernels, not a toy shape's
            self.forward(slot, list(range(n)), 0)
            self.forward(slot, [2], n)
            if self.static is not None:
                self.static.capture(self.slots, self._lock)
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
        return (time.perf_counter() - t0) * 1000
