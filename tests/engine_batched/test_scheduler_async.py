"""Async scheduling's bookkeeping (scheduler.py `advance` / `resolve`), with random runs (hypothesis) against the
fake model of scheduler_runs.py: step N+1 is scheduled and advanced before step N is resolved, and
the fake device runs the launched steps in launch order, each reading the tokens and block tables its launch
saw (a fed token that is still a placeholder there is the previous step's sample, as on the device). Every
sequence must end with exactly the synchronous run's tokens, every work must read KV its own tokens produced,
and no placeholder may be left or read.

Steps of the three kinds the engine takes, in a drawn order: overlapped (`step_overlapped`), resolve-then-launch
(its first-token path) and whole (`step()`: sampling at temperature > 0, `call_between_steps`). Pressure runs
(a KV cache of one max_model_len sequence and a block or two, bursts beyond max_num_seqs, a queue that refuses)
make preemptions of sequences with a token in flight, queued sequences holding a placeholder, and refusals."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from engines.batched.scheduler import Batch, Scheduler, SchedulerConfig
from engines.batched.sequence import PENDING, SeqStatus, Sequence
from tests.engine_batched.scheduler_runs import (
    PROPS,
    Req,
    Run,
    Scenario,
    check_outcomes,
    check_state,
    run_to_end,
    scenarios,
)


@dataclass
class Launch:
    batch: Batch
    tables: list[list[int]]  # each work's block table when launched (the runner copies it into its inputs)
    sampled: dict[int, int] = field(default_factory=dict)


OVERLAP, RESOLVE_FIRST, WHOLE = "overlap", "resolve_first", "whole"  # engine.py's kinds of step
STEP_KINDS = st.lists(st.sampled_from([OVERLAP, OVERLAP, RESOLVE_FIRST, WHOLE]), min_size=1, max_size=24)


@dataclass
class AsyncRun(Run):
    inflight: Launch | None = None
    kinds: list[str] = field(default_factory=lambda: [OVERLAP])  # the kind of step k: kinds[k % len(kinds)]

    def execute(self, launch: Launch, prev: Launch | None) -> None:
        """The fake device runs one launched step: a fed placeholder is `prev`'s sample of that sequence."""
        for w, table in zip(launch.batch.works, launch.tables, strict=True):
            seq = w.seq
            tokens = list(seq.tokens[:w.start + w.num_tokens])
            for p, t in enumerate(tokens):
                if t == PENDING:
                    assert p == w.start and w.num_tokens == 1 and prev is not None, "a placeholder fed as a prompt"
                    tokens[p] = prev.sampled[seq.seq_id]
            tok = self.compute(seq, tokens, table, w.start, w.num_tokens)
            if w.samples:
                launch.sampled[seq.seq_id] = tok

    def step(self) -> None:
        """Schedule and launch step N+1 with step N in flight, then resolve step N (OVERLAP); or resolve N first
        and leave N+1 in flight (RESOLVE_FIRST), or resolve both (WHOLE)."""
        kind = self.kinds[self.step_no % len(self.kinds)]
        self.add_arrivals()
        self.abort_due(between=False)
        if kind != OVERLAP and self.inflight is not None:
            self.sched.resolve(self.inflight.batch, self.inflight.sampled)
            self.inflight = None
        batch = self.sched.schedule()
        check_state(self.sched)
        for w in batch.works:
            assert w.seq.status is SeqStatus.RUNNING and w.start == w.seq.num_computed
        launch = Launch(batch, [list(w.seq.block_table) for w in batch.works])
        # The device runs in launch order; running this one now (before N is resolved) is one such order.
        self.execute(launch, self.inflight)
        self.sched.advance(batch)
        self.abort_due(between=True)
        prev, self.inflight = self.inflight, launch if batch.works else None
        if prev is not None:
            self.sched.resolve(prev.batch, prev.sampled)
        if kind == WHOLE and self.inflight is not None:
            self.sched.resolve(self.inflight.batch, self.inflight.sampled)
            self.inflight = None
        check_state(self.sched)
        for s in self.sched.running + self.sched.waiting:
            assert PENDING not in s.tokens[:s.num_known], "a placeholder left behind the resolved tokens"
            assert s.num_pending <= 1 and s.num_computed <= len(s.tokens) - 1
        self.step_no += 1

    def pending(self) -> bool:
        return self.inflight is not None or super().pending()


def run_and_check(sc: Scenario, kinds: list[str]) -> None:
    run = AsyncRun.fresh(sc, kinds=kinds)
    run_to_end(run)
    check_outcomes(run)
    assert all(s.num_pending == 0 and PENDING not in s.tokens for s in run.seqs.values())


@PROPS
@given(scenarios(), STEP_KINDS)
def test_async_runs_keep_every_invariant_and_finish_every_sequence(sc: Scenario, kinds: list[str]) -> None:
    run_and_check(sc, kinds)


@PROPS
@given(scenarios(pressure=True), STEP_KINDS)
def test_async_runs_under_pressure_lose_no_token(sc: Scenario, kinds: list[str]) -> None:
    """Preempted with a token in flight, queued behind a full queue, aborted mid-flight: every sequence served
    ends by its stop token or its length with the fake model's tokens (check_outcomes), none cut short."""
    run_and_check(sc, kinds)


@PROPS
@given(scenarios(aborts=False), STEP_KINDS)
def test_async_runs_end_with_the_synchronous_runs_tokens(sc: Scenario, kinds: list[str]) -> None:
    sync = Run.fresh(sc)
    run_to_end(sync)
    run = AsyncRun.fresh(sc, kinds=kinds)
    run_to_end(run)
    assert {i: s.tokens for i, s in run.seqs.items()} == {i: s.tokens for i, s in sync.seqs.items()}
    assert {i: s.finish_reason for i, s in run.seqs.items()} == {i: s.finish_reason for i, s in sync.seqs.items()}


def test_a_sequence_that_stops_while_its_next_step_runs_drops_that_row() -> None:
    """Scheduled once more before its stop token was known: the extra row is dropped, nothing appended."""
    from engines.batched.scheduler import SchedulerConfig
    from engines.batched.sequence import SamplingParams

    s = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32, eos_token_ids={0}))
    seq = Sequence.from_prompt(1, "r1", [3, 1, 2], SamplingParams(max_tokens=10))
    s.add(seq)
    b1 = s.schedule()
    s.advance(b1)
    assert seq.tokens == [3, 1, 2, PENDING] and seq.in_decode
    b2 = s.schedule()  # launched while b1 runs: feeds b1's pending token
    assert [(w.start, w.num_tokens) for w in b2.works] == [(3, 1)]
    s.advance(b2)
    r1 = s.resolve(b1, {1: 0})  # b1 sampled EOS
    assert r1.finished == (seq,) and seq.tokens == [3, 1, 2, 0] and seq.num_computed == 0
    assert s.resolve(b2, {1: 5}).new_tokens == {} and seq.tokens == [3, 1, 2, 0]
    assert s.bm.num_free_blocks == 8 and not s.has_unfinished


def test_a_sequence_whose_pending_token_is_its_last_is_not_scheduled_again() -> None:
    from engines.batched.scheduler import SchedulerConfig
    from engines.batched.sequence import SamplingParams

    s = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32))
    seq = Sequence.from_prompt(1, "r1", [3, 1, 2], SamplingParams(max_tokens=1))
    s.add(seq)
    b1 = s.schedule()
    s.advance(b1)
    assert s.schedule().works == ()  # max_tokens 1: the pending token ends it
    assert s.resolve(b1, {1: 7}).finished == (seq,) and seq.finish_reason == "length"


def test_a_sequence_preempted_with_its_token_in_flight_keeps_that_token_and_ends_whole() -> None:
    """Two prompts fill the four blocks; in the next step, launched while their first tokens are in flight, the
    older needs a fifth block and the newer is preempted with its placeholder. The step resolved after fills it
    in the waiting queue; the sequence is recomputed with it and ends with all its tokens, as synchronously."""
    config = SchedulerConfig(num_blocks=4, block_size=4, prefix_caching=False, max_model_len=16, max_num_seqs=2,
                             max_num_batched_tokens=16, prefill_chunk=8, eos_token_ids={0})
    sc = Scenario(config, [Req(0, [1, 2, 3, 1, 2, 3, 1, 2], 6, True, None),
                           Req(0, [3, 2, 1, 3, 2, 1, 3, 2], 6, True, None)])
    sched = Scheduler(config)
    preempted_pending = []
    preempt = sched._preempt

    def watched(seq: Sequence) -> None:
        preempted_pending.append((seq.seq_id, seq.num_pending))
        preempt(seq)

    sched._preempt = watched  # type: ignore[method-assign]
    run = AsyncRun(sc, sched)
    run.step()  # both prompts in; their first tokens in flight
    run.step()  # 0 needs a block: 1 is preempted holding its placeholder, which this step's resolve fills
    assert preempted_pending == [(1, 1)]
    assert sched.waiting == [run.seqs[1]] and run.seqs[1].num_pending == 0 and run.seqs[1].num_output == 1
    run_to_end(run)
    check_outcomes(run)
    sync = Run.fresh(sc)
    run_to_end(sync)
    assert [s.tokens for s in run.seqs.values()] == [s.tokens for s in sync.seqs.values()]
    assert all(s.num_output == 6 for s in run.seqs.values())
