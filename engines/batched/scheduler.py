"""Which sequences run in the next step, and what their results do to them. Pure: no torch, no I/O.

One step (`schedule`) is a `Batch` of `Work(seq, start, num_tokens)` (the contract in `__init__.py`):
1. every running sequence in decode gets its one token (a token is reserved for each before any prefill);
2. running sequences still in prefill get a chunk of at most `prefill_chunk` tokens, oldest first;
3. waiting sequences are admitted first come, first served while the token budget, `max_num_seqs` and the
   free blocks allow their whole first chunk; the head of the queue that does not fit stops admission (no
   later one overtakes it). `schedule(admit=False)` admits nobody this step (a successor's resumed streams get
   their first token before new prompts' prefill: engine.py).
When a running sequence needs a block and none is free, the most recently arrived running sequence is
preempted by recompute (blocks freed, num_computed = 0, back into the waiting queue at its arrival place),
never an older one: the oldest running sequence always progresses, so with a KV cache that holds one
`max_model_len` sequence every sequence finishes.

`commit(batch, sampled)` applies a step's results: num_computed advances, works that reached the end of
their tokens append the sampled token, finished sequences free their blocks, newly full blocks are
registered for prefix sharing. It is `advance(batch)` then `resolve(batch, sampled)`, which async scheduling
(engine.py) calls apart: `advance` right after the step is launched (num_computed moves on, each sampling work
appends a placeholder, sequence.py invariant 5), so that the next step is scheduled while this one runs on the
device; `resolve` once its tokens are read back (placeholders filled, stop tokens, blocks registered,
sequences finished). Scheduling with a step in flight: a sequence whose pending token certainly ends it (its
length) is not scheduled; one that turns out to have sampled a stop token was scheduled once more and that
work is dropped at its resolve (it wrote only KV past its end, in blocks freed after it in stream order). A
sequence preempted with a placeholder is not admitted again before the placeholder is resolved.

Deterministic mode: a prefill chunk spans `[k*C, min((k+1)*C, prompt_len))` (C = prefill_chunk), positions
past the prompt (recompute after preemption) go one per step as decode computed them, and prefix hits inside
the prompt are cut to a multiple of C; so every position of a sequence is computed in the same shape whatever
else runs, is cached, or was preempted. With batch-invariant kernels its numerics then depend only on the
sequence.

Invariants (tests/engine_batched/test_scheduler*.py):
1. A batch has at most `max_num_batched_tokens` tokens and `max_num_seqs` sequences; a sequence once.
2. Running and waiting are sorted by arrival; a sequence is in exactly one of them, or finished.
3. Sequences are first scheduled in arrival order.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from engines.batched.block_manager import AdoptionError, BlockManager
from engines.batched.sequence import PENDING, InvalidRequest, SeqStatus, Sequence, transition


class QueueFull(ValueError):
    """`max_waiting` sequences are queued already: refuse (HTTP 503, not 400), do not drop silently. A
    ValueError like the other refusals of `add`, so that one `except ValueError` turns them all away."""


class PromptTooLong(InvalidRequest):
    """The prompt leaves no room for output within `max_model_len` (HTTP 400)."""


class DuplicateRequest(InvalidRequest):
    """A live sequence already has this request id or sequence id."""


class StaleBatch(RuntimeError):
    """A batch committed twice, or against sequences it was not scheduled for (a bug in the caller)."""


class MissingSample(RuntimeError):
    """A work that reached the end of its tokens has no sampled token in the commit."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int  # KV blocks in the cache
    block_size: int = 16  # tokens per block
    prefix_caching: bool = True
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget of one step
    prefill_chunk: int = 256  # most prompt tokens of one sequence in one step
    max_waiting: int = 10_000
    deterministic: bool = False
    eos_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "prefill_chunk", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # Each running sequence must get at least its one token per step, and a whole chunk must fit.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} < max_num_seqs "
                             f"{self.max_num_seqs}: running sequences could not all decode in one step")
        if self.prefill_chunk > self.max_num_batched_tokens:
            raise ValueError(f"prefill_chunk {self.prefill_chunk} > max_num_batched_tokens")
        if self.num_blocks * self.block_size < self.max_model_len:  # else the oldest could starve
            raise ValueError(f"a KV cache of {self.num_blocks} blocks x {self.block_size} tokens cannot hold one "
                             f"sequence of max_model_len {self.max_model_len}")
        if self.deterministic and self.prefill_chunk % self.block_size:
            raise ValueError(f"deterministic mode needs prefill_chunk ({self.prefill_chunk}) to be a multiple of "
                             f"block_size ({self.block_size}), so that a block lies within one chunk")


class Work(NamedTuple):
    """Feed `seq.tokens[start:start + num_tokens]` at positions `start..`; `samples`: the last row is the
    end of the known tokens, so one token is sampled from it. (A tuple: hundreds are built per step.)"""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool


@dataclass(frozen=True, slots=True)
class Batch:
    works: tuple[Work, ...]  # decode works first, then prefill chunks
    preempted: tuple[Sequence, ...] = ()  # preempted while this batch was built (their blocks are free)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.works)

    @property
    def num_decode(self) -> int:
        return sum(1 for w in self.works if w.num_tokens == 1 and w.samples)

    def __len__(self) -> int:
        return len(self.works)


@dataclass(frozen=True, slots=True)
class StepResult:
    new_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> the token sampled this step
    finished: tuple[Sequence, ...] = ()


def _by_arrival(seq: Sequence) -> int:
    return seq.arrival


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        # Deterministic mode keys shared blocks by their chunk boundaries too (block_manager.py).
        self.bm = BlockManager(config.num_blocks, config.block_size, config.prefix_caching,
                               chunk_keyed=config.prefill_chunk if config.deterministic else None)
        self.running: list[Sequence] = []  # sorted by arrival
        self.waiting: list[Sequence] = []  # sorted by arrival; preempted ones return to their place
        self._live: dict[int, Sequence] = {}
        self._by_request: dict[str, Sequence] = {}
        self._next_arrival = 0
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.num_finished = 0
        self.num_aborted = 0

    # -- requests ----------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raises `PromptTooLong`, `QueueFull`, `DuplicateRequest`, `InvalidRequest`."""
        cfg = self.config
        if len(seq.tokens) >= cfg.max_model_len:
            raise PromptTooLong(f"request {seq.request_id!r}: {len(seq.tokens)} prompt tokens leave no room for "
                                f"output within the model's maximum context of {cfg.max_model_len} tokens")
        if seq.status is not SeqStatus.WAITING or seq.block_table or seq.num_computed:
            raise InvalidRequest(f"request {seq.request_id!r}: only a new waiting sequence may be added")
        if seq.num_output >= seq.params.max_tokens:
            raise InvalidRequest(f"request {seq.request_id!r}: {seq.num_output} output tokens already, "
                                 f"max_tokens {seq.params.max_tokens}")
        if seq.seq_id in self._live or seq.request_id in self._by_request:
            raise DuplicateRequest(f"request {seq.request_id!r} / sequence {seq.seq_id} is already live")
        if len(self.waiting) >= cfg.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests waiting (max_waiting {cfg.max_waiting})")
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        self.waiting.append(seq)  # the newest arrival: the end keeps the order
        self._track(seq)

    def get(self, key: str | int) -> Sequence | None:
        """The live sequence with this request id (str) or sequence id (int)."""
        return self._by_request.get(key) if isinstance(key, str) else self._live.get(key)

    def abort(self, key: str | int) -> Sequence | None:
        """Finish a live sequence now with reason "abort" and free its blocks at once (a client went away).
        Returns it, or None when none is live under that key (already finished: nothing to do). Call it
        between steps: a work of the batch in flight for it is skipped at commit."""
        seq = self.get(key)
        if seq is None:
            return None
        (self.running if seq.status is SeqStatus.RUNNING else self.waiting).remove(seq)
        self._finish(seq, "abort")
        self.num_aborted += 1
        return seq

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> dict[str, int]:
        """Counters for /health (JSON as it is)."""
        return {"running": len(self.running), "waiting": len(self.waiting), "preemptions": self.preemptions,
                "prefix_hit_tokens": self.prefix_hit_tokens, "prefix_query_tokens": self.prefix_query_tokens,
                "free_blocks": self.bm.num_free_blocks, "cached_blocks": self.bm.num_cached_blocks,
                "num_blocks": self.bm.num_blocks, "finished": self.num_finished, "aborted": self.num_aborted}

    # -- one step ----------------------------------------------------------------------------------------
    def schedule(self, *, admit: bool = True) -> Batch:
        budget = self.config.max_num_batched_tokens
        bs = self.bm.block_size
        reserved = sum(1 for s in self.running if s.in_decode)  # one token each, kept from prefills
        decodes: list[Work] = []
        prefills: list[Work] = []
        preempted: list[Sequence] = []
        blocked = False  # a running sequence went without, or one was preempted: admit nobody this step
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            decode = seq.in_decode
            if decode:
                reserved -= 1
                n = 1
                if seq.num_pending and self._ends_by_length(seq, len(seq.tokens)):
                    i += 1  # its pending token is its last: resolve finishes it
                    continue
                if len(seq.tokens) <= len(seq.block_table) * bs:  # most decodes: their slot is there
                    decodes.append(Work(seq, seq.num_computed, 1, True))
                    budget -= 1
                    i += 1
                    continue
            else:
                n = self._chunk(seq, seq.num_computed, budget - reserved)
                if n == 0:
                    blocked = True
                    i += 1
                    continue
            n, victims = self._fit_blocks(seq, n, shrink=not decode and not self.config.deterministic)
            preempted.extend(v for v, _ in victims)
            reserved -= sum(1 for v, was_decode in victims if was_decode and v is not seq)
            blocked = blocked or bool(victims)  # blocks were short: admitting now would only thrash
            if n == 0:  # seq was the newest running one and gave its own blocks up
                blocked = True
                continue
            self.bm.allocate(seq, n)
            (decodes if decode else prefills).append(self._work(seq, n))
            budget -= n
            i += 1
        if admit and not blocked:
            self._admit(budget, prefills)
        return Batch(tuple(decodes + prefills), tuple(preempted))

    def _chunk(self, seq: Sequence, start: int, avail: int) -> int:
        """Tokens of seq's next prefill chunk from `start` within `avail` budget; 0 when none fits."""
        c = self.config.prefill_chunk
        if self.config.deterministic:
            # Boundaries that depend only on the sequence: a whole chunk or nothing.
            end = min((start // c + 1) * c, seq.prompt_len) if start < seq.prompt_len else start + 1
            return end - start if end - start <= avail else 0
        return max(0, min(c, len(seq.tokens) - start, avail))

    def _fit_blocks(self, seq: Sequence, n: int, shrink: bool) -> tuple[int, list[tuple[Sequence, bool]]]:
        """Make room for seq's next n tokens: shrink the chunk to the free blocks if allowed, else preempt
        the newest running sequences (seq itself last, then 0 is returned). Returns the tokens that fit and
        the victims with whether each was in decode (its reserved token is released)."""
        victims: list[tuple[Sequence, bool]] = []
        while not self.bm.can_allocate(seq, n):
            if shrink and (m := self.bm.max_allocatable(seq)) >= 1:
                return m, victims
            victim = self.running[-1]
            victims.append((victim, victim.in_decode))
            self._preempt(victim)
            if victim is seq:
                return 0, victims
        return n, victims

    def _admit(self, budget: int, prefills: list[Work]) -> None:
        """Admit waiting sequences in arrival order while they fit; the first that does not stops it."""
        bs, cfg = self.bm.block_size, self.config
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with a token in flight: its tokens are known after the resolve
                return
            prefix = self.bm.cached_prefix(seq)
            if cfg.deterministic and len(prefix) * bs < seq.prompt_len:
                prefix = prefix[:len(prefix) * bs // cfg.prefill_chunk * cfg.prefill_chunk // bs]
            start = len(prefix) * bs
            n = self._chunk(seq, start, budget)
            # The whole first chunk or nothing: a sliver of the last free blocks would be preempted again
            # by the next decode that needs a block (the head waits instead, and so does everyone after it).
            if n == 0 or not self.bm.can_allocate(seq, n, prefix):
                return
            self.bm.allocate(seq, n, prefix)
            self.prefix_query_tokens += len(seq.tokens)
            self.prefix_hit_tokens += start
            seq.num_cached_tokens = start
            self.waiting.pop(0)
            transition(seq, SeqStatus.RUNNING)
            bisect.insort(self.running, seq, key=_by_arrival)
            prefills.append(self._work(seq, n))
            budget -= n

    @staticmethod
    def _work(seq: Sequence, n: int) -> Work:
        return Work(seq, seq.num_computed, n, samples=seq.num_computed + n == len(seq.tokens))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: blocks back to the pool, KV forgotten, queued again at its arrival place."""
        self.running.remove(seq)
        self.bm.free(seq)
        transition(seq, SeqStatus.PREEMPTED)
        seq.num_preemptions += 1
        self.preemptions += 1
        transition(seq, SeqStatus.WAITING)
        bisect.insort(self.waiting, seq, key=_by_arrival)

    # -- results -----------------------------------------------------------------------------------------
    def commit(self, batch: Batch, sampled: dict[int, int]) -> StepResult:
        """Apply a step's results. `sampled[seq_id]` is the token sampled for each work with `samples`."""
        self.advance(batch)
        return self.resolve(batch, sampled)

    def advance(self, batch: Batch) -> None:
        """A step launched: its works' positions count as computed, each sampling work appends a placeholder
        (filled by `resolve`). Call once per batch, before the next `schedule`."""
        for w in batch.works:
            seq = w.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted after it was scheduled; its blocks are free already
            if w.start != seq.num_computed:
                raise StaleBatch(f"sequence {seq.seq_id}: work starts at {w.start}, computed {seq.num_computed}")
            seq.num_computed += w.num_tokens
            if w.samples:
                seq.tokens.append(PENDING)
                seq.num_pending += 1

    def resolve(self, batch: Batch, sampled: dict[int, int]) -> StepResult:
        """An advanced step's tokens are known: fill its placeholders (in order: the oldest first), stop
        sequences at a stop token or their length, register newly full blocks."""
        new_tokens: dict[int, int] = {}
        finished: list[Sequence] = []
        for w in batch.works:
            seq = w.seq
            if seq.status is SeqStatus.FINISHED:
                continue  # aborted, or stopped by an earlier step's token: this work is dropped
            done = w.start + w.num_tokens  # positions computed as of this step
            reason = None
            if w.samples:
                if seq.seq_id not in sampled:
                    raise MissingSample(f"sequence {seq.seq_id} reached its end but no token was sampled")
                at = len(seq.tokens) - seq.num_pending  # this step's placeholder: the oldest one left
                if at != done or seq.num_pending == 0:
                    raise StaleBatch(f"sequence {seq.seq_id}: no placeholder at {done} to resolve")
                token = sampled[seq.seq_id]
                seq.tokens[at] = token
                seq.num_pending -= 1
                new_tokens[seq.seq_id] = token
                reason = self._stop_reason(seq, token, at + 1)
            if reason is not None:  # a later step's work for it (launched meanwhile) is dropped
                del seq.tokens[done + 1:]
                seq.num_pending = 0
                if seq.status is SeqStatus.RUNNING:
                    seq.num_computed = done
                    self.bm.register(seq)
                    self.running.remove(seq)
                else:  # preempted while this step ran: it ends from the queue
                    self.waiting.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
            elif seq.status is SeqStatus.RUNNING:
                # positions below num_computed have known tokens (a later step in flight fed only this step's
                # token); their KV is written in stream order before any later step reads a shared block
                self.bm.register(seq)
        return StepResult(new_tokens, tuple(finished))

    def _ends_by_length(self, seq: Sequence, length: int) -> bool:
        return length - seq.prompt_len >= seq.params.max_tokens or length >= self.config.max_model_len

    def _stop_reason(self, seq: Sequence, token: int, length: int) -> str | None:
        """"stop" for a stop token (EOS unless ignore_eos) before "length" (max_tokens or max_model_len), for
        the token at position length - 1."""
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.config.eos_token_ids):
            return "stop"
        return "length" if self._ends_by_length(seq, length) else None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.num_pending:  # aborted with a step in flight: its pending tokens are never read
            del seq.tokens[seq.num_known:]
            seq.num_pending = 0
        self.bm.free(seq)
        transition(seq, SeqStatus.FINISHED)
        seq.finish_reason = reason
        del self._live[seq.seq_id]
        del self._by_request[seq.request_id]
        if reason != "abort":
            self.num_finished += 1

    def _track(self, seq: Sequence) -> None:
        self._live[seq.seq_id] = seq
        self._by_request[seq.request_id] = seq

    # -- adoption ----------------------------------------------------------------------------------------
    def adopt(self, seqs: list[Sequence], hold: Iterable[int] = ()) -> None:
        """Take over sequences from a journal as running: each keeps its block table and continues from its
        num_computed (decode, or the rest of its prefill), with no recompute. Only into a scheduler with no
        live sequences; everything is checked first, and an inconsistent set raises `AdoptionError` with
        nothing changed. Arrival order: the sequences' own if all are set, else the order given."""
        if self._live:
            raise AdoptionError("adopt needs a scheduler with no live sequences")
        if len(seqs) > self.config.max_num_seqs:
            raise AdoptionError(f"{len(seqs)} sequences > max_num_seqs {self.config.max_num_seqs}")
        self._check_adoptable(seqs)
        self.bm.adopt(seqs, hold)
        unordered = all(s.arrival < 0 for s in seqs)
        for k, s in enumerate(seqs):
            if s.status is SeqStatus.WAITING:  # as built from a journal entry
                transition(s, SeqStatus.RUNNING)
            if unordered:
                s.arrival = k
            self._track(s)
        self.running = sorted(seqs, key=_by_arrival)
        self._next_arrival = max((s.arrival for s in seqs), default=-1) + 1

    def _check_adoptable(self, seqs: list[Sequence]) -> None:
        if len({s.seq_id for s in seqs}) != len(seqs) or len({s.request_id for s in seqs}) != len(seqs):
            raise AdoptionError("two adopted sequences share a sequence id or request id")
        arrivals = [s.arrival for s in seqs]
        if not all(a < 0 for a in arrivals) and (min(arrivals) < 0 or len(set(arrivals)) != len(arrivals)):
            raise AdoptionError("arrival orders must be all unset or all distinct and >= 0")
        for s in seqs:
            if s.status not in (SeqStatus.WAITING, SeqStatus.RUNNING):
                raise AdoptionError(f"sequence {s.seq_id} is {s.status.value}: only live sequences are adopted")
            if not 0 <= s.num_computed < len(s.tokens) or len(s.tokens) > self.config.max_model_len:
                raise AdoptionError(f"sequence {s.seq_id}: {s.num_computed} computed of {len(s.tokens)} tokens "
                                    f"(max_model_len {self.config.max_model_len})")
