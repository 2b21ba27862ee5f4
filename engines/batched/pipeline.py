"""`StepPipeline`: one step of the batched engine, whole (`step`) or overlapped with the next (`step_overlapped`).

A step: `Scheduler.schedule()` -> journal (rows of sequences that left, new admissions, new block-table entries)
-> the runner launches it -> `Scheduler.advance()` -> its tokens read back -> `Scheduler.resolve()` -> journal
commit -> tokens to their requests' sinks. The step loop (engine.py) picks which of the two kinds runs.

Async scheduling (overlapped steps): the host's work of a step is done while the device runs the previous one, as
vLLM v1 does. Step N+1 is scheduled and launched (`ModelRunner.launch`, greedy argmax on the device) while step N
is still in flight: `Scheduler.advance` left a placeholder for each token N samples, and N+1's decode rows take
those tokens from N's device tensor. Only then are N's tokens read back (one event), resolved
(`Scheduler.resolve`: stop tokens, finished sequences), journaled and streamed. Invariants:
1. A token is streamed only after its journal write is queued (stream order), and the journal's progress never
   runs ahead of resolved tokens.
2. A sequence's journal row is released before a step's forward can write into blocks it no longer holds
   (journal.py invariant 4).
3. At most one step is in flight (`inflight`); a step that samples some sequence's first token is resolved before
   the next launch. The cost of overlap: a sequence that sampled a stop token runs one more (dropped) row.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from engines.batched.drain import NO_MARK, Mark
from engines.batched.journal import Admission, Journal
from engines.batched.live import Counters, Live, LiveSet, finish_reason
from engines.batched.model_runner import Launched, ModelRunner, RunItem
from engines.batched.scheduler import Batch, Scheduler
from engines.batched.sequence import SeqStatus, Sequence

log = logging.getLogger("holdfast.engine.batched")


class StepTimes:
    """Where the step thread's time goes (ms): totals per phase and the slowest steps with their make-up, for
    /health (the stalls a stream sees are the step thread's slowest passes)."""

    KEEP = 8
    FIRST = 4  # the first passes kept whole: a recovered engine's first steps are its streams' first tokens
    LOG_MS = 50.0  # a pass this long is logged with its make-up (a stall every stream in decode sees)

    def __init__(self) -> None:
        self.total: dict[str, float] = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "resolve": 0.0}
        self.steps = 0
        self.slowest: list[dict[str, Any]] = []
        self.origin = time.perf_counter()  # the pipeline's making (an engine's start, a recovery's adoption)
        self.origin_wall = time.time()  # the same moment on the wall clock: the first passes on a failover's timeline
        self.first: list[dict[str, Any]] = []  # each of the first passes: its phases and when it ended
        self._pass: dict[str, float] = {}  # the phases of the pass under way (an overlapped step's launch included)
        self._cpu_at = 0.0  # the step thread's CPU time where a first pass's schedule ended (`add`)

    def add(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        ms = (now - t0) * 1000
        self.total[phase] += ms
        if self.steps < self.FIRST:
            self._pass[phase] = self._pass.get(phase, 0.0) + ms
            # a first pass's launch also as the step thread's own CPU time: the rest of it, the thread waited (for
            # the interpreter, while the HTTP front's link takes a takeover's burst of resumed requests, or the CPU).
            # A whole step's launch (`step`: nothing in flight, a recovery's first) holds `runner.run`, which waits
            # for the device, and CUDA's wait spins: its GPU time counts as CPU here too.
            cpu = time.thread_time()
            if phase == "launch":
                self._pass["launch_cpu"] = self._pass.get("launch_cpu", 0.0) + (cpu - self._cpu_at) * 1000
            self._cpu_at = cpu  # a launch begins where its schedule ended
        return now

    def step(self, ms: float, rows: int, prefill_tokens: int, graph: bool) -> None:
        self.steps += 1
        if self.steps <= self.FIRST:
            self.first.append({"at_step": self.steps, "ms": round(ms, 2), "rows": rows, "prefill_tokens": prefill_tokens,
                               "decode_only": graph, "ended_ms": round((time.perf_counter() - self.origin) * 1000, 2),
                               **{k: round(v, 2) for k, v in self._pass.items()}})
            self._pass = {}
        if ms > self.LOG_MS:
            log.info("slow step %d: %.1f ms, %d rows, %d prefill tokens", self.steps, ms, rows, prefill_tokens)
        if len(self.slowest) < self.KEEP or ms > self.slowest[-1]["ms"]:
            self.slowest.append({"ms": round(ms, 2), "rows": rows, "prefill_tokens": prefill_tokens, "decode_only": graph,
                                 "at_step": self.steps})
            self.slowest.sort(key=lambda r: -r["ms"])
            del self.slowest[self.KEEP:]

    def stats(self) -> dict[str, Any]:
        return {"steps": self.steps, "total_ms": {k: round(v, 1) for k, v in self.total.items()},
                "slowest": self.slowest, "first": self.first, "origin_wall": self.origin_wall}


@dataclass
class InFlight:
    """A launched step: its batch, and its tokens (read back later through `launched`, or known: `tokens`)."""

    batch: Batch
    launched: Launched | None
    tokens: list[int | None] | None
    rows: dict[int, int]  # seq_id -> its row in the launched step's device tokens (sampling works)
    t0: float
    first_tokens: bool = False  # it samples some sequence's first token (the last row of its prompt)


class StepPipeline:
    """Runs steps over the live sequences of `table`; the step thread is its only caller. `scheduler` may be
    replaced between steps (sleep.py: a new cache keeps no prefix block), never with a step in flight."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, journal: Journal, table: LiveSet,
                 counters: Counters) -> None:
        self.runner, self.scheduler, self.journal = runner, scheduler, journal
        self.table, self.counters = table, counters
        self.times = StepTimes()
        self.inflight: InFlight | None = None  # the launched step not resolved yet (async scheduling)
        self._last_resolved = 0.0
        self.mark: Mark = NO_MARK  # drain.py: each phase that queues GPU work bracketed (engine.py sets it)

    def step(self) -> bool:
        """One whole step (the one in flight first, if any): its tokens are handed to their sinks on return."""
        self.resolve_inflight()
        launched = self.launch(overlap=False)
        if launched is not None:
            self.resolve(launched)
        return launched is not None

    def step_overlapped(self) -> bool:
        """Launch the next step while the one in flight runs, then resolve the one in flight. False: nothing
        was launched and nothing was in flight."""
        prev = self.inflight
        if prev is not None and prev.first_tokens and not self.scheduler.waiting:
            # New sequences' first tokens are handed out before the next launch, not after its host work (a
            # mixed step's eager launches in deterministic mode; on the CPU the whole next step): a request's
            # first token then costs its own step, not two. The overlap is lost for this one step. Not while
            # requests wait to be admitted: they would wait for the step in flight before theirs is launched
            # (H200, 64 streams + 16 new: taken in -> first scheduled 26 ms at the median, 55 at p99).
            self.inflight = None
            self.resolve(prev)
            self.inflight = self.launch(overlap=True)
            return True
        self.inflight = self.launch(overlap=True)
        if prev is not None:
            self.counters.overlapped_steps += self.inflight is not None
            self.resolve(prev)
        return prev is not None or self.inflight is not None

    def resolve_inflight(self) -> None:
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self.resolve(prev)

    def launch(self, *, overlap: bool) -> InFlight | None:
        self.mark.open()  # rows released and admitted in the journal, the forward: closed once queued
        try:
            return self._launch(overlap=overlap)
        finally:
            self.mark.close()

    def _launch(self, *, overlap: bool) -> InFlight | None:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule(admit=self.table.admitting())
        live_seqs = self.table.live
        # Sequences that left the running set (preempted) give their journal rows up before this step's forward
        # writes into the blocks they held (journal.py invariant 4).
        for live in live_seqs.values():
            if live.slot is not None and live.seq.status != SeqStatus.RUNNING:
                self.table.release(live)
        if not batch.works:
            return None
        prev = self.inflight if overlap else None
        items: list[RunItem] = []
        written: list[int] = []  # the KV blocks this forward writes (drain.py invariant 2)
        bs = self.scheduler.config.block_size
        prefill = 0
        grown: list[tuple[int, list[int]]] = []  # journal rows whose block tables grew: one write for all
        for w in batch.works:
            seq = w.seq
            live = live_seqs[seq.seq_id]
            if live.req is not None and not live.req.t_scheduled:
                live.req.t_scheduled = t0
            self._journal_admit(live, grown)
            end = w.start + w.num_tokens
            written += seq.block_table[w.start // bs:(end - 1) // bs + 1]
            feed = -1
            if end > seq.num_known:  # its token is the step in flight's sample, still on the device
                assert prev is not None and w.num_tokens == 1, "only a decode work feeds a pending token"
                feed = prev.rows[seq.seq_id]
            # the runner reads block tables while launching: no copy needed
            items.append(RunItem(token_ids=[0] if feed >= 0 else seq.tokens[w.start:end], start=w.start,
                                 block_table=seq.block_table, sample=w.samples, temperature=seq.params.temperature,
                                 seed=seq.params.seed or 0, feed=feed))
            if not w.samples or w.num_tokens > 1:
                prefill += w.num_tokens
        self.journal.grow_many(grown)  # before the forward that writes into the new blocks
        self.counters.prefill_tokens += prefill
        self.mark.touch_blocks(written)
        t1 = self.times.add("schedule", t0)
        launched: Launched | None = None
        tokens: list[int | None] | None = None
        rows: dict[int, int] = {}
        if overlap:
            launched = self.runner.launch(items, None if prev is None else prev.launched)
            rows = {w.seq.seq_id: r for w, r in zip(batch.works, launched.rows, strict=True) if r is not None}
        else:
            tokens = self.runner.run(items)
        self.times.add("launch", t1)
        first = any(w.samples and w.start + w.num_tokens == w.seq.prompt_len for w in batch.works)
        self.scheduler.advance(batch)
        return InFlight(batch, launched, tokens, rows, t0, first)

    def resolve(self, f: InFlight) -> None:
        t0 = time.perf_counter()
        out = f.launched.tokens() if f.launched is not None else f.tokens or []
        t1 = self.times.add("wait", t0)
        self.mark.open()  # the journal's writes below (commit, rows released)
        batch = f.batch
        sampled = {w.seq.seq_id: tok for w, tok in zip(batch.works, out, strict=True) if tok is not None}
        self.counters.dropped_rows += sum(1 for w in batch.works if w.seq.status == SeqStatus.FINISHED)
        result = self.scheduler.resolve(batch, sampled)
        self._journal_commit(batch, sampled, result.finished)
        self.counters.steps += 1
        self.counters.tokens += len(result.new_tokens)
        self._stream(batch)
        for seq in result.finished:
            done = self.table.live.get(seq.seq_id)
            if done is None:
                continue
            if done.sink is not None:
                done.sink.finish(finish_reason(seq), seq.prompt_len, len(seq.tokens) - seq.prompt_len)
                self.counters.requests_done += 1
                self.table.leave(done)
            else:  # an adopted sequence that finished unclaimed waits (its tokens) for its claim, or its expiry
                self.table.release(done)
        self.mark.close()
        now = self.times.add("resolve", t1)
        # the gap a decoding stream saw: since the previous step's tokens were handed out (or this one's launch)
        gap = now - max(self._last_resolved, f.t0)
        self._last_resolved = now
        prefill = sum(w.num_tokens for w in batch.works if not w.samples or w.num_tokens > 1)
        self.times.step(gap * 1000, len(batch.works), prefill, prefill == 0)

    def _journal_commit(self, batch: Batch, sampled: dict[int, int], finished: tuple[Sequence, ...]) -> None:
        """The resolved step's progress, for every row still the journal's (invariant 1: before its stream)."""
        updates = []
        for w in batch.works:
            live = self.table.live.get(w.seq.seq_id)
            if live is None or live.slot is None or live.seq is not w.seq:
                continue  # gone (aborted, left) or its row given up (preempted)
            if w.seq.status == SeqStatus.FINISHED and w.seq not in finished:
                continue  # stopped by an earlier step: this row was dropped
            updates.append((live.slot, w.seq.num_known, w.start + w.num_tokens, sampled.get(w.seq.seq_id)))
        self.journal.commit(updates)

    def _stream(self, batch: Batch) -> None:
        """Each claimed sequence's new tokens to its sink."""
        for w in batch.works:
            live = self.table.live.get(w.seq.seq_id)
            if live is not None and live.sink is not None:
                seq = live.seq
                if live.req is not None and not live.req.t_first_token and live.sent < seq.num_known - seq.prompt_len:
                    live.req.t_first_token = time.perf_counter()
                while live.sent < seq.num_known - seq.prompt_len:
                    live.sink.token(seq.tokens[seq.prompt_len + live.sent])
                    live.sent += 1
                    self.table.resuming.discard(seq.seq_id)

    def _journal_admit(self, live: Live, grown: list[tuple[int, list[int]]]) -> None:
        """A new sequence's journal row, or (into `grown`) a journaled one's block table, to grow with the step's."""
        seq = live.seq
        if live.slot is None:
            live.slot = self.journal.admit(Admission(seq.seq_id, seq.request_id, seq.tokens[:seq.num_known], seq.prompt_len,
                                                     seq.params.max_tokens, seq.params.temperature, seq.params.seed or 0,
                                                     seq.params.ignore_eos), seq.block_table)
            if live.slot is None:
                self.counters.unjournaled += 1
        else:
            grown.append((live.slot, seq.block_table))
