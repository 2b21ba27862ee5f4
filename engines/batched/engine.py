"""`LLMEngine`: the step loop of the batched engine, on one thread of its own.

Each step: take new requests and aborts -> `Scheduler.schedule()` -> journal (rows of sequences that left, new
admissions, new block-table entries) -> `ModelRunner.run()` -> `Scheduler.commit()` -> journal commit -> tokens
to their requests' sinks. The HTTP layer never touches the scheduler: it hands requests in through `submit`
and gets tokens back through its `Sink` (called from the step thread; thread-safe on the sink's side).

Async scheduling (the step loop's default; `async_schedule=False` turns it off): the host's work of a step is
done while the device runs the previous one, as vLLM v1 does. Step N+1 is scheduled and launched
(`ModelRunner.launch`, greedy argmax on the device) while step N is still in flight: `Scheduler.advance` left a
placeholder for each token N samples, and N+1's decode rows take those tokens from N's device tensor. Only then
are N's tokens read back (one event), resolved (`Scheduler.resolve`: stop tokens, finished sequences), journaled
and streamed. So a token is still streamed only after its journal write is queued (stream order), and the
journal's progress never runs ahead of resolved tokens. The cost: a sequence that sampled a stop token runs one
more (dropped) row. The loop steps synchronously (`step()`) while adopted sequences await their claims, while any
live sequence samples with temperature > 0 (sampled on the host), and around `call_between_steps`.

Recovery (journal.py): a successor handed the KV lease adopts every sequence the journal committed and runs
them at once, with no prefill (their KV is there). Until a resumed request claims it, an adopted sequence's
tokens wait in its buffer; the claim matches the request id the router sends (or, failing that, the tokens),
and reconciles the two views of the sequence: tokens the client saw past the journal are taken as given, and
tokens the engine made past what the client saw are sent first. An adopted sequence nobody claims within
`adopt_claim_s` is dropped and its blocks freed.
"""

from __future__ import annotations

import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.batched.journal import Admission, Entry, Journal
from engines.batched.model_runner import Launched, ModelRunner, RunItem
from engines.batched.scheduler import Batch, QueueFull, Scheduler
from engines.batched.sequence import SamplingParams, SeqStatus, Sequence
from libs.common.tokenizer import EOS

log = logging.getLogger("holdfast.engine.batched")
STOP = frozenset({EOS})
REFUSED_FULL, REFUSED_BAD = "refused:queue_full", "refused:bad_request"  # finish reasons of a refused request
# Tokens an unclaimed adopted sequence makes ahead of its claim. Its claim sends them at once (the client's
# first token after a failover costs no step); past them, while every live sequence is unclaimed, the step
# thread waits for claims instead of running on: the router's replay burst is taken by the HTTP thread, which
# shares the interpreter with the step thread.
ADOPTED_AHEAD = 4
# While adopted sequences wait for their claims, the interpreter switches threads every 0.5 ms, not 5 ms: the
# HTTP thread taking the replay burst (80 requests at 64 + 16 streams) gets its turns while the step thread runs
# Python (a graph capture, a step). Only then: serving 256 streams, the shorter interval cost the step thread
# more than it gave (H200, 8b: ITL p50 33 ms against 25 ms).
CLAIM_SWITCH_INTERVAL_S = 0.0005
# After a takeover no new request is admitted (no prefill chunk joins a step) until every claimed adopted
# sequence has sent its first token after its claim, or this long after the adoption: the first steps are pure
# decode (the captured graph, ~7 ms at 8b x 64), not mixed steps with the late prompts' prefill (the
# no-failure control's largest gap, ~160 ms at 64 + 16 on the H200, was that prefill). Admission order and
# prefill chunks are unchanged, so deterministic outputs are too.
RESUME_FIRST_S = 0.5


class Sink(Protocol):
    """Where one request's output goes (called on the step thread)."""

    def token(self, token: int) -> None: ...

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None: ...


@dataclass
class Request:
    request_id: str
    context: list[int]  # prompt (+ tokens) + the tokens a predecessor already generated (resume)
    max_tokens: int  # still to generate
    temperature: float
    seed: int
    ignore_eos: bool
    sink: Sink
    resumed: int = 0  # how many of the context's last tokens a predecessor generated (a router's replay)
    # Where its first token's time went (perf_counter; 0: not yet): received, handed in (`submit`), taken by the step
    # thread (intake), first in a launched step, first token handed to its sink. Written by the step thread
    # before the sink's items that follow them; read by the HTTP side after its final item.
    t_received: float = 0.0  # the HTTP handler had it (set there)
    t_submit: float = 0.0
    t_intake: float = 0.0
    t_scheduled: float = 0.0
    t_first_token: float = 0.0


@dataclass
class _Live:
    seq: Sequence
    sink: Sink | None  # None: adopted, not claimed yet
    slot: int | None = None
    sent: int = 0  # tokens past the prompt handed to the sink
    adopted_at: float = 0.0
    adopted_len: int = 0  # tokens at adoption (journal)
    t_submit: float = field(default_factory=time.perf_counter)
    req: Request | None = None  # the request it serves (its timestamps); None: adopted, not claimed yet


@dataclass
class Counters:
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    requests_done: int = 0
    aborted: int = 0
    adopted: int = 0
    adopted_dropped: int = 0
    claimed: int = 0
    claim_extra_tokens: int = 0  # tokens the client saw past the journal (fed, not recomputed)
    recomputed_tokens: int = 0  # context of replayed requests this engine did not hold: prefilled again
    journal_dropped: int = 0
    unjournaled: int = 0
    overlapped_steps: int = 0  # steps launched while the previous one was in flight
    dropped_rows: int = 0  # rows of sequences that had already stopped (async scheduling's one extra)


@dataclass
class _InFlight:
    """A launched step: its batch, and its tokens (read back later through `launched`, or known: `tokens`)."""

    batch: Batch
    launched: Launched | None
    tokens: list[int | None] | None
    rows: dict[int, int]  # seq_id -> its row in the launched step's device tokens (sampling works)
    t0: float
    first_tokens: bool = False  # it samples some sequence's first token (the last row of its prompt)


class StepTimes:
    """Where the step thread's time goes (ms): totals per phase and the slowest steps with their make-up, for
    /health (the stalls a stream sees are the step thread's slowest passes)."""

    KEEP = 8
    LOG_MS = 50.0  # a pass this long is logged with its make-up (a stall every stream in decode sees)

    def __init__(self) -> None:
        self.total: dict[str, float] = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "resolve": 0.0}
        self.steps = 0
        self.slowest: list[dict[str, Any]] = []

    def add(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.total[phase] += (now - t0) * 1000
        return now

    def step(self, ms: float, rows: int, prefill_tokens: int, graph: bool) -> None:
        self.steps += 1
        if ms > self.LOG_MS:
            log.info("slow step %d: %.1f ms, %d rows, %d prefill tokens", self.steps, ms, rows, prefill_tokens)
        if len(self.slowest) < self.KEEP or ms > self.slowest[-1]["ms"]:
            self.slowest.append({"ms": round(ms, 2), "rows": rows, "prefill_tokens": prefill_tokens, "decode_only": graph,
                                 "at_step": self.steps})
            self.slowest.sort(key=lambda r: -r["ms"])
            del self.slowest[self.KEEP:]

    def stats(self) -> dict[str, Any]:
        return {"steps": self.steps, "total_ms": {k: round(v, 1) for k, v in self.total.items()},
                "slowest": self.slowest}


def request_params(max_tokens: int, temperature: float, seed: int, ignore_eos: bool) -> SamplingParams:
    """A request's sampling and stop rule: EOS ends it unless it asked `ignore_eos`. A stop token ends a sequence
    whatever `ignore_eos` says (scheduler.py `_stop_reason`), so EOS is one only for a request that stops at it
    (issue 17: with EOS always a stop token, an `ignore_eos` request ended at its first EOS)."""
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          stop_token_ids=frozenset() if ignore_eos else STOP, ignore_eos=ignore_eos)


def finish_reason(seq: Sequence) -> str:
    reason = seq.finish_reason or "length"
    return "eos" if reason == "stop" else reason


class LLMEngine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, journal: Journal, *, adopt_claim_s: float,
                 capture_graphs_when_idle: bool = False, async_schedule: bool = True) -> None:
        self.runner, self.scheduler, self.journal = runner, scheduler, journal
        self.adopt_claim_s = adopt_claim_s
        self.async_schedule = async_schedule
        self._inflight: _InFlight | None = None  # the launched step not resolved yet (async scheduling)
        self._last_resolved = 0.0
        self.times = StepTimes()
        self.counters = Counters()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, _Live] = {}  # seq_id -> live sequence
        self._by_request: dict[str, int] = {}
        self._orphans: dict[int, _Live] = {}  # adopted, not claimed yet
        self._resuming: set[int] = set()  # adopted, no token sent since its claim yet (RESUME_FIRST_S)
        self._resume_until = 0.0
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # called on the step thread after each pass (new requests taken, a step run): the HTTP side hands the
        # pass's tokens to their requests at once (one wake-up of its loop a pass, not one a token)
        self.flush: Callable[[], None] = lambda: None
        self._capture_when_idle = capture_graphs_when_idle
        self.capture_first: list[int] = []  # graph buckets captured before the first step (a recovery's own)
        self.graphs_captured_ms: dict[str, float] = {}
        self.fatal: BaseException | None = None
        self._switch_interval: float | None = None  # the interpreter's, while a recovery's claims are awaited

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

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ recovery
    def adopt(self, entries: list[Entry], dropped: int) -> None:
        """Sequences a predecessor committed to the journal: running again at once (before `start`)."""
        now = time.perf_counter()
        seqs: list[Sequence] = []
        for e in entries:
            params = request_params(e.max_tokens, e.temperature, e.seed, e.ignore_eos)
            seq = Sequence(seq_id=next(self._ids), request_id=e.request_id, tokens=list(e.tokens),
                           prompt_len=e.prompt_len, params=params)
            seq.num_computed = e.computed
            seq.block_table = list(e.block_table)
            seqs.append(seq)
            live = _Live(seq, None, e.slot, sent=len(e.tokens) - e.prompt_len, adopted_at=now, adopted_len=len(e.tokens))
            self._live[seq.seq_id] = live
            self._orphans[seq.seq_id] = live
        self.scheduler.adopt(seqs)
        self._resuming = {seq.seq_id for seq in seqs}
        self._resume_until = now + RESUME_FIRST_S
        if seqs and self._switch_interval is None:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(CLAIM_SWITCH_INTERVAL_S)
        self.counters.adopted += len(seqs)
        self.counters.journal_dropped += dropped

    # ------------------------------------------------------------------ the step thread
    def _capture(self, label: str, buckets: list[int] | None) -> None:
        t0 = time.perf_counter()
        self.runner.capture_graphs(buckets)
        self.graphs_captured_ms[label] = round((time.perf_counter() - t0) * 1000, 1)

    def _loop(self) -> None:
        try:
            if self.capture_first:
                self._capture("first", self.capture_first)
            while not self._stop.is_set():
                self._drain()
                # what intake produced (a claim's tokens made ahead, a refusal) goes out now, not after this
                # pass's step: a successor's claims would otherwise wait a whole step for their first tokens
                self.flush()
                if self._overlap():
                    ran = self.step_overlapped()
                else:
                    ran = False if self._ahead_of_claims() else self.step()
                self.flush()
                if ran:
                    continue
                # a recovered engine's graphs, once nothing waits: not while adopted sequences await their claims
                # (capturing every bucket would hold the claims that come in meanwhile)
                if self._capture_when_idle and not self._orphans:
                    self._capture_when_idle = False
                    self._capture("when_idle", None)
                    continue
                self._wake.wait(0.05)
                self._wake.clear()
            self._resolve_inflight()
        except BaseException as e:  # noqa: BLE001 - a broken step is fatal: reported, and the process ends
            log.exception("the engine's step loop failed")
            self.fatal = e
            for live in list(self._live.values()):
                if live.sink is not None:
                    live.sink.finish("error", 0, 0)
            self.flush()

    def _ahead_of_claims(self) -> bool:
        """Every live sequence is adopted and unclaimed, and each has its ADOPTED_AHEAD tokens (or has ended):
        no step is needed until a claim or a new request comes."""
        if not self._orphans or len(self._orphans) != len(self._live):
            return False
        return all(o.seq.status == SeqStatus.FINISHED or len(o.seq.tokens) - o.adopted_len >= ADOPTED_AHEAD
                   for o in self._orphans.values())

    def _drain(self) -> None:
        while True:
            try:
                op, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if op == "submit":
                self._admit(arg)
            elif op == "call":
                self._resolve_inflight()  # nothing in flight while it runs
                self.flush()
                arg()
            else:
                self._abort(arg)
        self._expire_orphans()
        if not self._orphans and self._switch_interval is not None:  # every claim in (or expired)
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def _admit(self, req: Request) -> None:
        req.t_intake = time.perf_counter()
        live = self._claim(req)
        if live is not None:
            self.counters.claimed += 1
            return
        if req.resumed:  # a replay of a generation whose KV this engine does not hold: all of it again
            self.counters.recomputed_tokens += len(req.context)
        old = self._by_request.get(req.request_id)
        if old is not None:  # the same request again (a router's retry here): the newer one wins
            self._abort(req.request_id)
        # The tokens a predecessor generated are the sequence's output, not its prompt: the scheduler feeds them
        # the way they were first computed (in deterministic mode one per step, as decode made them), so the
        # continuation is the uninterrupted run's; they are not sent again.
        params = request_params(req.resumed + req.max_tokens, req.temperature, req.seed, req.ignore_eos)
        seq = Sequence(seq_id=next(self._ids), request_id=req.request_id, tokens=list(req.context),
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
        self._live[seq.seq_id] = _Live(seq, req.sink, sent=req.resumed, req=req)
        self._by_request[req.request_id] = seq.seq_id

    def _claim(self, req: Request) -> _Live | None:
        """An adopted sequence this resumed request continues, reconciled with what the client saw."""
        if not self._orphans:
            return None
        sid = self._by_request.get(req.request_id) if req.request_id else None
        live = self._orphans.get(sid) if sid is not None else None
        if live is None:  # no id (an older router): the same tokens and sampling
            live = next((o for o in self._orphans.values() if _prefix_related(o.seq.tokens, req.context)
                         and o.seq.params.seed == req.seed and o.seq.params.temperature == req.temperature), None)
        if live is None or len(req.context) < live.seq.prompt_len or not _prefix_related(live.seq.tokens, req.context):
            return None
        seq = live.seq
        extra = req.context[len(seq.tokens):]
        if extra and seq.status == SeqStatus.FINISHED:
            return None  # the client saw more than this sequence ever made: not the same generation
        if extra:  # the client saw tokens the journal had not committed: they are the sequence's, as given
            seq.tokens.extend(extra)
            self.counters.claim_extra_tokens += len(extra)
        del self._orphans[seq.seq_id]
        live.sink, live.req = req.sink, req
        # the client has everything up to its context; send what the engine made past it
        live.sent = len(req.context) - seq.prompt_len
        if len(seq.tokens) > len(req.context):
            req.t_first_token = time.perf_counter()
        for tok in seq.tokens[len(req.context):]:
            req.sink.token(tok)
            live.sent += 1
            self._resuming.discard(seq.seq_id)
        self._by_request[req.request_id] = seq.seq_id
        if seq.status == SeqStatus.FINISHED:  # it ended while unclaimed: its tokens are all there
            req.sink.finish(finish_reason(seq), seq.prompt_len, len(seq.tokens) - seq.prompt_len)
            self.counters.requests_done += 1
            self._leave(live)
        return live

    def _abort(self, request_id: str) -> None:
        sid = self._by_request.pop(request_id, None)
        live = self._live.get(sid) if sid is not None else None
        if live is None or live.seq.status == SeqStatus.FINISHED:
            return
        self.scheduler.abort(live.seq.seq_id)
        self._leave(live)
        self.counters.aborted += 1

    def _expire_orphans(self) -> None:
        now = time.perf_counter()
        for live in [o for o in self._orphans.values() if now - o.adopted_at > self.adopt_claim_s]:
            del self._orphans[live.seq.seq_id]
            if live.seq.status != SeqStatus.FINISHED:
                self.scheduler.abort(live.seq.seq_id)
            self._leave(live)
            self.counters.adopted_dropped += 1

    def _leave(self, live: _Live) -> None:
        self._resuming.discard(live.seq.seq_id)
        self._live.pop(live.seq.seq_id, None)
        if self._by_request.get(live.seq.request_id) == live.seq.seq_id:
            del self._by_request[live.seq.request_id]
        if live.slot is not None:
            self.journal.release(live.slot)
            live.slot = None

    def _admitting(self) -> bool:
        """New requests join steps again once every resumed stream has its first token after the failover."""
        if self._resuming and time.perf_counter() > self._resume_until:
            self._resuming.clear()
        return not self._resuming

    def _overlap(self) -> bool:
        """Step with overlap now: on, no adopted sequence awaiting its claim, every live sequence greedy."""
        return (self.async_schedule and not self._orphans
                and all(live.seq.params.temperature <= 0 for live in self._live.values()))

    def step(self) -> bool:
        """One whole step (the one in flight first, if any): its tokens are handed to their sinks on return."""
        self._resolve_inflight()
        launched = self._launch(overlap=False)
        if launched is not None:
            self._resolve(launched)
        return launched is not None

    def step_overlapped(self) -> bool:
        """Launch the next step while the one in flight runs, then resolve the one in flight. False: nothing
        was launched and nothing was in flight."""
        prev = self._inflight
        if prev is not None and prev.first_tokens:
            # New sequences' first tokens are handed out before the next launch, not after its host work (a
            # mixed step's eager launches in deterministic mode; on the CPU the whole next step): a request's
            # first token then costs its own step, not two. The overlap is lost for this one step.
            self._inflight = None
            self._resolve(prev)
            self._inflight = self._launch(overlap=True)
            return True
        self._inflight = self._launch(overlap=True)
        if prev is not None:
            self.counters.overlapped_steps += self._inflight is not None
            self._resolve(prev)
        return prev is not None or self._inflight is not None

    def _resolve_inflight(self) -> None:
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._resolve(prev)

    def _launch(self, *, overlap: bool) -> _InFlight | None:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule(admit=self._admitting())
        # Sequences that left the running set (preempted) give their journal rows up before this step's forward
        # writes into the blocks they held (journal.py invariant 4).
        for live in self._live.values():
            if live.slot is not None and live.seq.status != SeqStatus.RUNNING:
                self.journal.release(live.slot)
                live.slot = None
        if not batch.works:
            return None
        prev = self._inflight if overlap else None
        items: list[RunItem] = []
        prefill = 0
        for w in batch.works:
            seq = w.seq
            live = self._live[seq.seq_id]
            if live.req is not None and not live.req.t_scheduled:
                live.req.t_scheduled = t0
            self._journal_admit(live)
            end = w.start + w.num_tokens
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
        self.counters.prefill_tokens += prefill
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
        return _InFlight(batch, launched, tokens, rows, t0, first)

    def _resolve(self, f: _InFlight) -> None:
        t0 = time.perf_counter()
        out = f.launched.tokens() if f.launched is not None else f.tokens or []
        t1 = self.times.add("wait", t0)
        batch = f.batch
        sampled = {w.seq.seq_id: tok for w, tok in zip(batch.works, out, strict=True) if tok is not None}
        self.counters.dropped_rows += sum(1 for w in batch.works if w.seq.status == SeqStatus.FINISHED)
        result = self.scheduler.resolve(batch, sampled)
        updates = []
        for w in batch.works:
            live = self._live.get(w.seq.seq_id)
            if live is None or live.slot is None or live.seq is not w.seq:
                continue  # gone (aborted, left) or its row given up (preempted)
            if w.seq.status == SeqStatus.FINISHED and w.seq not in result.finished:
                continue  # stopped by an earlier step: this row was dropped
            updates.append((live.slot, w.seq.num_known, w.start + w.num_tokens, sampled.get(w.seq.seq_id)))
        self.journal.commit(updates)
        self.counters.steps += 1
        self.counters.tokens += len(result.new_tokens)
        for w in batch.works:
            live = self._live.get(w.seq.seq_id)
            if live is not None and live.sink is not None:
                seq = live.seq
                if live.req is not None and not live.req.t_first_token and live.sent < seq.num_known - seq.prompt_len:
                    live.req.t_first_token = time.perf_counter()
                while live.sent < seq.num_known - seq.prompt_len:
                    live.sink.token(seq.tokens[seq.prompt_len + live.sent])
                    live.sent += 1
                    self._resuming.discard(seq.seq_id)
        for seq in result.finished:
            done = self._live.get(seq.seq_id)
            if done is None:
                continue
            if done.sink is not None:
                done.sink.finish(finish_reason(seq), seq.prompt_len, len(seq.tokens) - seq.prompt_len)
                self.counters.requests_done += 1
                self._leave(done)
            # an adopted sequence that finished unclaimed waits (its tokens) for its claim, or its expiry
            elif done.slot is not None:
                self.journal.release(done.slot)
                done.slot = None
        now = self.times.add("resolve", t1)
        # the gap a decoding stream saw: since the previous step's tokens were handed out (or this one's launch)
        gap = now - max(self._last_resolved, f.t0)
        self._last_resolved = now
        prefill = sum(w.num_tokens for w in batch.works if not w.samples or w.num_tokens > 1)
        self.times.step(gap * 1000, len(batch.works), prefill, prefill == 0)

    def _journal_admit(self, live: _Live) -> None:
        seq = live.seq
        if live.slot is None:
            live.slot = self.journal.admit(Admission(seq.seq_id, seq.request_id, seq.tokens[:seq.num_known], seq.prompt_len,
                                                     seq.params.max_tokens, seq.params.temperature, seq.params.seed or 0,
                                                     seq.params.ignore_eos), seq.block_table)
            if live.slot is None:
                self.counters.unjournaled += 1
        else:
            self.journal.grow(live.slot, seq.block_table)

    def stats(self) -> dict[str, Any]:
        return {**self.counters.__dict__, "live": len(self._live), "unclaimed": len(self._orphans),
                "graphs_captured_ms": self.graphs_captured_ms, "step_times": self.times.stats(),
                "scheduler": self.scheduler.stats() if hasattr(self.scheduler, "stats") else {}}


def _prefix_related(a: list[int], b: list[int]) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


