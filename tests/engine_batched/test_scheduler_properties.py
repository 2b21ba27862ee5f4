"""Random runs of the scheduler and block manager (hypothesis): arrivals, prompt and output lengths, budgets,
block counts, shared prefixes, aborts (also between schedule and commit), preemptions, adoption by a successor,
checked against the fake model and KV oracle of scheduler_runs.py.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.batched.scheduler import Scheduler
from engines.batched.sequence import Sequence
from tests.engine_batched.scheduler_runs import PROPS, Run, Scenario, check_outcomes, run_to_end, scenarios


@PROPS
@given(scenarios())
def test_random_runs_keep_every_invariant_and_finish_every_sequence(sc: Scenario) -> None:
    run = Run.fresh(sc)
    run_to_end(run)
    check_outcomes(run)
    # First scheduling follows arrival order (FCFS): no waiting sequence is overtaken.
    assert run.first_scheduled == sorted(run.first_scheduled)


def journal_copy(seq: Sequence) -> Sequence:
    """What a journal keeps of a running sequence, rebuilt by a successor."""
    c = Sequence(seq.seq_id, seq.request_id, list(seq.tokens), seq.prompt_len, seq.params)
    c.num_computed, c.block_table, c.arrival = seq.num_computed, list(seq.block_table), seq.arrival
    return c


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios(aborts=False), st.integers(0, 40))
def test_a_successor_adopting_at_a_random_step_ends_as_the_uninterrupted_run(sc: Scenario, kill_at: int) -> None:
    whole = Run.fresh(sc)
    run_to_end(whole)
    run = Run.fresh(sc)
    while run.pending() and run.step_no < kill_at:
        run.step()
    old = run.sched
    succ = Scheduler(sc.config)
    succ.adopt([journal_copy(s) for s in old.running])
    for s in old.waiting:  # the queue is not journaled: the router sends those requests again
        again = Sequence(s.seq_id, s.request_id, list(s.tokens), s.prompt_len, s.params)
        succ.add(again)
        run.seqs[s.seq_id] = again
    # The adopted state is the predecessor's: same running order, tables, computed positions, reference counts.
    assert [(s.seq_id, s.block_table, s.num_computed) for s in succ.running] == \
        [(s.seq_id, s.block_table, s.num_computed) for s in old.running]
    assert [succ.bm.ref_count(b) for b in range(sc.config.num_blocks)] == \
        [old.bm.ref_count(b) for b in range(sc.config.num_blocks)]
    assert succ.bm.num_free_blocks == old.bm.num_free_blocks
    for s in succ.running:
        run.seqs[s.seq_id] = s
    run.sched = succ  # the KV cache (run.kv) survives: the successor must find its sequences' KV there
    run_to_end(run)
    check_outcomes(run)
    assert {i: s.tokens for i, s in run.seqs.items()} == {i: s.tokens for i, s in whole.seqs.items()}
