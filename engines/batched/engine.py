"""`LLMEngine`: the step loop of the batched engine, on one thread of its own.

Each pass of the loop: take new requests, aborts and calls (intake) -> one step (pipeline.py: schedule, journal,
run, resolve, journal commit, tokens to their requests' sinks) -> `flush`. The HTTP layer never touches the
scheduler: it hands requests in through `submit` and gets tokens back through its `Sink` (called from the step
thread; thread-safe on the sink's side).

The modules it composes, each owning one concern:
- live.py: `Request`, `Sink`, and `LiveSet`, the one table of live sequences every part below shares;
- pipeline.py: `StepPipeline`, a step whole (`step()`) or overlapped with the next (`step_overlapped()`,
  async scheduling, the default; `async_schedule=False` turns it off);
- claims.py: `Claims`, the sequences adopted from a predecessor's journal and the resumed requests that claim
  them (recovery).
The loop steps synchronously (`step()`) while adopted sequences await their claims, while any live sequence
samples with temperature > 0 (sampled on the host), and around `call_between_steps`; while every live sequence
is adopted, unclaimed and ADOPTED_AHEAD tokens ahead, it waits for claims instead of stepping.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from engines.batched.claims import Claims
from engines.batched.drain import NO_MARK, DrainMark
from engines.batched.isolation import Held
from engines.batched.journal import Entry, Journal
from engines.batched.live import REFUSED_BAD, REFUSED_FULL, Counters, Live, LiveSet, Request, request_params
from engines.batched.model_runner import ModelRunner
from engines.batched.pipeline import StepPipeline
from engines.batched.scheduler import QueueFull, Scheduler
from engines.batched.sequence import SeqStatus, Sequence

log = logging.getLogger("holdfast.engine.batched")


class LLMEngine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, journal: Journal, *, adopt_claim_s: float,
                 capture_graphs_when_idle: bool = False, async_schedule: bool = True,
                 forget_on_failure: bool = True) -> None:
        self.async_schedule = async_schedule
        # journal.py invariant 5; False for a rank of a tensor-parallel group, whose step loop most often fails
        # because a peer rank died (a collective's error): its successor group adopts the journal as ever
        self.forget_on_failure = forget_on_failure
        self.counters = Counters()
        self.table = LiveSet(journal)
        self.pipeline = StepPipeline(runner, scheduler, journal, self.table, self.counters)
        self.claims = Claims(self.table, self.counters, adopt_claim_s)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # called on the step thread after each pass (new requests taken, a step run): the HTTP side hands the
        # pass's tokens to their requests at once (one wake-up of its loop a pass, not one a token)
        self.flush: Callable[[], None] = lambda: None
        self.drain: DrainMark | None = None  # drain.py: each pass's GPU work bracketed, for a successor's fence
        self.held: Held | None = None  # isolation.py: slots and blocks a dead predecessor may still write
        self.held_back_ms: float | None = None  # when they came back, after the adoption
        self._adopted_at = 0.0
        self._capture_when_idle = capture_graphs_when_idle
        self.capture_first: list[int] = []  # graph buckets captured before the first step (a recovery's own)
        self.graphs_captured_ms: dict[str, float] = {}
        self.fatal: BaseException | None = None

    # The pipeline's parts, as the start-up and sleep.py see them. A new scheduler (sleep.py, between steps) is
    # the pipeline's from its next step on.
    @property
    def runner(self) -> ModelRunner:
        return self.pipeline.runner

    @property
    def journal(self) -> Journal:
        return self.pipeline.journal

    @property
    def scheduler(self) -> Scheduler:
        return self.pipeline.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:
        self.pipeline.scheduler = scheduler

    # ------------------------------------------------------------------ the HTTP side (any thread)
    def submit(self, req: Request) -> None:
        req.t_submit = time.perf_counter()
        self._inbox.put(("submit", req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def call_between_steps(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the step thread between two steps (no step in flight while it runs): sleep.py parks the
        thread there while the memory sleeps."""
        self._inbox.put(("call", fn))
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Whether the step thread ended (within 10 s)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return self._thread is None or not self._thread.is_alive()

    # ------------------------------------------------------------------ recovery
    def adopt(self, entries: list[Entry], dropped: int, hold: Iterable[int] = ()) -> None:
        """Sequences a predecessor committed to the journal: running again at once (before `start`); `hold`: blocks
        it may still write, out of the pool until `held` is over."""
        self._adopted_at = time.perf_counter()
        self.claims.adopt(self.scheduler, entries, dropped, hold)

    def _give_back(self) -> None:
        """The predecessor is gone: what was held back from it is this engine's (isolation.py rule 4)."""
        if self.held is None or not self.held.over():
            return
        mark = self.pipeline.mark
        mark.open()
        self.journal.give_back(sorted(self.held.slots))
        mark.touch_slots(self.held.slots)  # drain.py `hold`: no longer pending once this bracket's close ran
        mark.touch_blocks(self.scheduler.bm.give_back())
        mark.close()
        self.held = None
        self.held_back_ms = round((time.perf_counter() - self._adopted_at) * 1000, 1)

    # ------------------------------------------------------------------ the step thread
    def step(self) -> bool:
        """One whole step (the one in flight first, if any): its tokens are handed to their sinks on return."""
        return self.pipeline.step()

    def step_overlapped(self) -> bool:
        """Launch the next step while the one in flight runs, then resolve the one in flight."""
        return self.pipeline.step_overlapped()

    def _capture(self, label: str, buckets: list[int] | None) -> None:
        t0 = time.perf_counter()
        self.pipeline.mark.open()
        with self.journal.quiet():  # no other thread's CUDA work beside a capture (the KV backup's rounds wait)
            self.runner.capture_graphs(buckets)
        self.pipeline.mark.close()
        self.graphs_captured_ms[label] = round((time.perf_counter() - t0) * 1000, 1)

    def _loop(self) -> None:
        mark = self.drain or NO_MARK  # drain.py: every phase that queues GPU work bracketed, for a successor's fence
        self.pipeline.mark = mark
        if self.drain is not None:
            self.drain.close()  # the bracket its start-up opened (drain.py invariant 4)
        try:
            if self.capture_first:
                self._capture("first", self.capture_first)
            while not self._stop.is_set():
                if self._pass():
                    self._wake.wait(0.05)
                    self._wake.clear()
            self.pipeline.resolve_inflight()
        except BaseException as e:  # noqa: BLE001 - a broken step is fatal: reported, and the process ends
            log.exception("the engine's step loop failed")
            try:
                mark.open()  # the writes below are queued in it, and no close follows: a successor waits for the exit
                try:  # journal.py invariant 5; a CUDA error may leave the device unable to take these writes
                    if self.forget_on_failure:
                        self.journal.forget([live.slot for live in self.table.live.values() if live.slot is not None])
                except Exception:  # noqa: BLE001 - the process ends either way
                    log.exception("the journal could not be emptied after the failure")
                for live in list(self.table.live.values()):
                    if live.sink is not None:
                        live.sink.finish("error", 0, 0)
                self.flush()
            finally:  # set once the journal is emptied and every stream told: the main thread then ends the process
                self.fatal = e

    def _pass(self) -> bool:
        """One pass of the step thread: intake, then a step (or an idle capture). True: nothing ran, wait."""
        self._give_back()
        self._drain()
        # what intake produced (a claim's tokens made ahead, a refusal) goes out now, not after this
        # pass's step: a successor's claims would otherwise wait a whole step for their first tokens
        self.flush()
        if not self.table.orphans:  # an adoption's prefix hashes, once its claims' first tokens are out (~3 ms at
            self.scheduler.bm.register_pending()  # 64 sequences: block_manager.py invariant 6); else nothing
        if self._overlap():
            ran = self.step_overlapped()
        else:
            ran = False if self.claims.ahead() else self.step()
        self.flush()
        if ran:
            return False
        # a recovered engine's graphs, once nothing waits: not while adopted sequences await their claims
        # (capturing every bucket would hold the claims that come in meanwhile)
        if self._capture_when_idle and not self.table.orphans:
            self._capture_when_idle = False
            self._capture("when_idle", None)
            return False
        return True

    def _overlap(self) -> bool:
        """Step with overlap now: on, no adopted sequence awaiting its claim, every live sequence greedy."""
        return (self.async_schedule and not self.table.orphans
                and all(live.seq.params.temperature <= 0 for live in self.table.live.values()))

    def _drain(self) -> None:
        self.pipeline.mark.open()  # an abort's or an expiry's rows released, a sleep's writes: queued in it
        try:
            self._intake()
        finally:
            self.pipeline.mark.close()

    def _intake(self) -> None:
        while True:
            try:
                op, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if op == "submit":
                self._admit(arg)
            elif op == "call":
                self.pipeline.resolve_inflight()  # nothing in flight while it runs
                self.flush()
                arg()
            else:
                self._abort(arg)
        self.claims.expire(self.scheduler)

    def _admit(self, req: Request) -> None:
        req.t_intake = time.perf_counter()
        if self.claims.claim(req) is not None:
            self.counters.claimed += 1
            return
        if req.resumed:  # a replay of a generation whose KV this engine does not hold: all of it again
            self.counters.recomputed_tokens += len(req.context)
        if req.request_id in self.table.by_request:  # the same request again (a router's retry here): newer wins
            self._abort(req.request_id)
        # The tokens a predecessor generated are the sequence's output, not its prompt: the scheduler feeds them
        # the way they were first computed (in deterministic mode one per step, as decode made them), so the
        # continuation is the uninterrupted run's; they are not sent again.
        params = request_params(req.resumed + req.max_tokens, req.temperature, req.seed, req.ignore_eos)
        seq = Sequence(seq_id=self.table.next_id(), request_id=req.request_id, tokens=list(req.context),
                       prompt_len=len(req.context) - req.resumed, params=params)
        try:
            self.scheduler.add(seq)
        except QueueFull:  # the HTTP layer checked; a burst raced it
            req.sink.finish(REFUSED_FULL, len(req.context), 0)
            return
        except ValueError as e:
            log.warning("request %s refused: %s", req.request_id, e)
            req.sink.finish(REFUSED_BAD, len(req.context), 0)
            return
        self.table.live[seq.seq_id] = Live(seq, req.sink, sent=req.resumed, req=req)
        self.table.by_request[req.request_id] = seq.seq_id

    def _abort(self, request_id: str) -> None:
        sid = self.table.by_request.pop(request_id, None)
        live = self.table.live.get(sid) if sid is not None else None
        if live is None or live.seq.status == SeqStatus.FINISHED:
            return
        self.scheduler.abort(live.seq.seq_id)
        self.table.leave(live)
        self.counters.aborted += 1

    def stats(self) -> dict[str, Any]:
        return {**self.counters.__dict__, "live": len(self.table.live), "unclaimed": len(self.table.orphans),
                "graphs_captured_ms": self.graphs_captured_ms, "step_times": self.pipeline.times.stats(),
                "holding_back": self.held is not None, "held_back_ms": self.held_back_ms,
                "scheduler": self.scheduler.stats() if hasattr(self.scheduler, "stats") else {}}
