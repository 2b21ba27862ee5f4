"""Async scheduling's bookkeeping (scheduler.py `advance` / `resolve`), with random runs (hypothesis) against the
fake model of test_scheduler_properties.py: step N+1 is scheduled and advanced before step N is resolved, and
the fake device runs the launched steps in launch order, each reading the tokens and block tables its launch
saw (a fed token that is still a placeholder there is the previous step's sample, as on the device). Every
sequence must end with exactly the synchronous run's tokens, every work must read KV its own tokens produced,
and no placeholder may be left or read."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given

from engines.batched.scheduler import Batch, Scheduler
from engines.batched.sequence import PENDING, SeqStatus, Sequence
from tests.engine_batched.test_scheduler_properties import (
    PROPS,
    Run,
    Scenario,
    check_outcomes,
    expected_shape,
    fake_next_token,
    prefix_ids,
    run_to_end,
    scenarios,
)


@dataclass
class Launch:
    batch: Batch
    tables: list[list[int]]  # each work's block table when launched (the runner copies it into its inputs)
    sampled: dict[int, int] = field(default_factory=dict)


@dataclass
class AsyncRun(Run):
    inflight: Launch | None = None
    done: list[Launch] = field(default_factory=list)  # launched and run by the fake device, not resolved

    def execute(self, launch: Launch, prev: Launch | None) -> None:
        """The fake device runs one launched step: a fed placeholder is `prev`'s sample of that sequence."""
        cfg = self.sc.config
        bs = cfg.block_size
        for w, table in zip(launch.batch.works, launch.tables, strict=True):
            seq = w.seq
            tokens = list(seq.tokens[:w.start + w.num_tokens])
            for p, t in enumerate(tokens):
                if t == PENDING:
                    assert p == w.start and w.num_tokens == 1 and prev is not None, "a placeholder fed as a prompt"
                    tokens[p] = prev.sampled[seq.seq_id]
            ids = prefix_ids(tokens)
            for p in range(w.start):
                cell = self.kv[table[p // bs] * bs + p % bs]
                assert cell is not None and cell[0] == ids[p], f"seq {seq.seq_id} reads foreign KV at {p}"
                if cfg.deterministic:
                    assert cell[1] == expected_shape(seq, p, cfg.prefill_chunk), "KV computed in another shape"
            for p in range(w.start, w.start + w.num_tokens):
                self.kv[table[p // bs] * bs + p % bs] = (ids[p], (w.start, w.start + w.num_tokens))
            if w.samples:
                launch.sampled[seq.seq_id] = fake_next_token(tokens)

    def step(self) -> None:
        """Schedule and launch step N+1 with step N in flight, then resolve step N."""
        self.add_arrivals()
        self.abort_due(between=False)
        batch = self.sched.schedule()
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
        for s in self.sched.running + self.sched.waiting:
            assert PENDING not in s.tokens[:s.num_known], "a placeholder left behind the resolved tokens"
            assert s.num_pending <= 1 and s.num_computed <= len(s.tokens) - 1
        self.step_no += 1

    def pending(self) -> bool:
        return self.inflight is not None or super().pending()


@PROPS
@given(scenarios())
def test_async_runs_keep_every_invariant_and_finish_every_sequence(sc: Scenario) -> None:
    run = AsyncRun(sc, Scheduler(sc.config))
    run_to_end(run)
    check_outcomes(run)
    assert all(s.num_pending == 0 and PENDING not in s.tokens for s in run.seqs.values())


@PROPS
@given(scenarios(aborts=False))
def test_async_runs_end_with_the_synchronous_runs_tokens(sc: Scenario) -> None:
    sync = Run(sc, Scheduler(sc.config))
    run_to_end(sync)
    run = AsyncRun(sc, Scheduler(sc.config))
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
