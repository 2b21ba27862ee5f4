"""The scheduler's rules one by one (engines/batched/scheduler.py); random runs in test_scheduler_properties.py."""

from __future__ import annotations

import pytest

from engines.batched.block_manager import AdoptionError
from engines.batched.scheduler import (
    Batch,
    DuplicateRequest,
    MissingSample,
    PromptTooLong,
    QueueFull,
    Scheduler,
    SchedulerConfig,
    StaleBatch,
)
from engines.batched.sequence import InvalidRequest, SamplingParams, SeqStatus, Sequence

BS = 4


def make(num_blocks: int = 64, **kw) -> Scheduler:
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("prefill_chunk", 8)
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, **kw))


def req(sid: int, n: int, max_tokens: int = 4, first: int = 0, **params) -> Sequence:
    return Sequence.from_prompt(sid, f"r{sid}", [first + i for i in range(n)],
                                SamplingParams(max_tokens=max_tokens, **params))


def step(s: Scheduler, token: int = 1) -> Batch:
    b = s.schedule()
    s.commit(b, {w.seq.seq_id: token for w in b.works if w.samples})
    return b


def shape(b: Batch) -> list[tuple[int, int, int]]:
    return [(w.seq.seq_id, w.start, w.num_tokens) for w in b.works]


# -- configuration and admission ---------------------------------------------------------------------------

@pytest.mark.parametrize(("kw", "match"), [
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "could not all decode"),
    ({"prefill_chunk": 64, "max_num_batched_tokens": 32}, "prefill_chunk"),
    ({"num_blocks": 4, "max_model_len": 64}, "cannot hold one"),
    ({"deterministic": True, "prefill_chunk": 6}, "multiple of"),
    ({"max_waiting": 0}, "max_waiting"),
])
def test_inconsistent_settings_are_refused(kw: dict, match: str) -> None:
    base = {"num_blocks": 64, "block_size": BS, "max_model_len": 64, "max_num_batched_tokens": 32,
            "max_num_seqs": 8, "prefill_chunk": 8} | kw
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**base)


def test_a_prompt_without_room_for_output_is_refused() -> None:
    s = make()
    with pytest.raises(PromptTooLong, match="maximum context of 64"):
        s.add(req(1, 64))
    s.add(req(2, 63))
    assert s.stats()["waiting"] == 1


def test_the_queue_refuses_past_max_waiting_and_keeps_the_others() -> None:
    s = make(max_waiting=3)
    for i in range(3):
        s.add(req(i, 5))
    with pytest.raises(QueueFull):
        s.add(req(9, 5))
    assert [q.seq_id for q in s.waiting] == [0, 1, 2]


def test_a_live_request_id_or_sequence_id_cannot_be_added_twice() -> None:
    s = make()
    s.add(req(1, 5))
    with pytest.raises(DuplicateRequest):
        s.add(Sequence.from_prompt(2, "r1", [1, 2]))
    with pytest.raises(DuplicateRequest):
        s.add(Sequence.from_prompt(1, "other", [1, 2]))


def test_only_a_new_sequence_can_be_added() -> None:
    s = make()
    old = req(1, 5)
    old.num_computed = 2
    with pytest.raises(InvalidRequest):
        s.add(old)


# -- what a step holds ---------------------------------------------------------------------------------------

def test_a_long_prompt_is_prefilled_in_chunks_and_samples_only_at_its_end() -> None:
    s = make()
    s.add(req(1, 20))
    shapes = [shape(step(s))[0] for _ in range(3)]
    assert shapes == [(1, 0, 8), (1, 8, 8), (1, 16, 4)]
    seq = s.get(1)
    assert seq.num_output == 1 and seq.in_decode
    assert shape(step(s)) == [(1, 20, 1)]


def test_decodes_come_first_and_keep_their_token_when_prefills_fill_the_budget() -> None:
    s = make(max_num_batched_tokens=10, prefill_chunk=8)
    s.add(req(1, 3, max_tokens=10))
    s.add(req(2, 3, max_tokens=10))
    step(s)  # both prefilled, now in decode
    s.add(req(3, 30))
    s.add(req(4, 30))
    b = step(s)
    assert shape(b)[:2] == [(1, 3, 1), (2, 3, 1)]
    assert shape(b)[2:] == [(3, 0, 8)]  # 10 - 2 decode tokens = 8 for prefill; 4 waits
    assert b.num_tokens == 10 and b.num_decode == 2


def test_a_step_that_does_not_admit_runs_the_decodes_and_leaves_the_queue_as_it_was() -> None:
    s = make(max_num_batched_tokens=64, prefill_chunk=8)
    s.add(req(1, 3, max_tokens=10))
    step(s)  # in decode now
    s.add(req(2, 5))
    b = s.schedule(admit=False)
    assert shape(b) == [(1, 3, 1)]
    s.commit(b, {1: 7})
    assert [q.seq_id for q in s.waiting] == [2]
    assert shape(step(s)) == [(1, 4, 1), (2, 0, 5)]


def test_max_num_seqs_bounds_the_running_set() -> None:
    s = make(max_num_seqs=2, max_num_batched_tokens=32)
    for i in range(4):
        s.add(req(i, 2))
    b = s.schedule()
    assert [w.seq.seq_id for w in b.works] == [0, 1] and len(s.running) == 2


def test_a_waiting_sequence_is_not_overtaken_by_a_later_one_that_fits() -> None:
    s = make(num_blocks=16, max_model_len=64, max_num_batched_tokens=64, prefill_chunk=64)
    s.add(req(1, 40))  # ten blocks
    step(s)
    s.add(req(2, 40, first=100))  # needs ten blocks, six are free
    s.add(req(3, 3))  # would fit, but arrived later
    b = s.schedule()
    assert [w.seq.seq_id for w in b.works] == [1]
    assert [q.seq_id for q in s.waiting] == [2, 3]


def test_an_admission_waits_until_its_whole_first_chunk_has_blocks() -> None:
    s = make(num_blocks=16, max_model_len=64, max_num_batched_tokens=64, prefill_chunk=64)
    s.add(req(1, 40))
    step(s)
    s.add(req(2, 40, first=100))
    assert shape(s.schedule()) == [(1, 40, 1)]  # six free blocks would hold 24 of its 40 tokens: it waits
    s.abort(1)
    assert shape(s.schedule()) == [(2, 0, 40)]


# -- preemption ----------------------------------------------------------------------------------------------

def test_when_blocks_run_out_the_newest_running_sequence_is_preempted_never_the_oldest() -> None:
    s = make(num_blocks=16, max_model_len=64, max_num_batched_tokens=64, prefill_chunk=64)
    s.add(req(1, 28, max_tokens=30))  # 7 blocks
    s.add(req(2, 28, max_tokens=30, first=100))  # 7 blocks, 2 left
    step(s)
    preempted = []
    for _ in range(12):
        b = step(s)
        preempted += [p.seq_id for p in b.preempted]
        if preempted:
            break
    assert preempted == [2]
    old, new = s.get(1), s.get(2)
    assert old.status is SeqStatus.RUNNING and old.num_preemptions == 0
    assert new.status is SeqStatus.WAITING and new.num_preemptions == 1
    assert new.block_table == [] and new.num_computed == 0 and new.num_output > 0
    assert s.stats()["preemptions"] == 1


def test_a_preempted_sequence_goes_back_ahead_of_later_arrivals() -> None:
    s = make(num_blocks=16, max_model_len=64, max_num_batched_tokens=64, prefill_chunk=64)
    s.add(req(1, 28, max_tokens=30))
    s.add(req(2, 28, max_tokens=30, first=100))
    step(s)
    s.add(req(3, 30, first=200))  # arrives later; cannot be admitted while blocks are short
    while not s.get(2).num_preemptions:
        step(s)
    assert [q.seq_id for q in s.waiting] == [2, 3]


def test_the_newest_sequence_preempts_itself_when_it_alone_is_short() -> None:
    s = make(num_blocks=16, max_model_len=64, max_num_batched_tokens=64, prefill_chunk=64)
    s.add(req(1, 32, max_tokens=30))  # 8 blocks exactly, needs a ninth to decode
    s.add(req(2, 32, max_tokens=30, first=100))
    step(s)
    b = s.schedule()
    # 1 takes a ninth block after preempting 2 (newer); 2 does not run.
    assert shape(b) == [(1, 32, 1)] and [p.seq_id for p in b.preempted] == [2]


def test_no_sequence_is_admitted_in_a_step_that_preempted_one() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=7, block_size=1, prefix_caching=False, max_model_len=7,
                                  max_num_batched_tokens=8, max_num_seqs=4, prefill_chunk=2))
    s.add(req(1, 3, max_tokens=3))
    s.add(req(2, 4, max_tokens=3, first=100))
    step(s)
    step(s)  # both sampled their first token; all seven blocks held
    b = s.schedule()
    # 1 needs a block: 2 (newest) is preempted; its first chunk would fit the blocks left, but it must wait
    assert [p.seq_id for p in b.preempted] == [2] and shape(b) == [(1, 3, 1)]
    assert s.get(2).status is SeqStatus.WAITING


def test_a_preempted_sequence_recomputes_and_finishes_with_its_tokens_kept() -> None:
    s = make(num_blocks=16, max_model_len=64, max_num_batched_tokens=64, prefill_chunk=64)
    s.add(req(1, 28, max_tokens=30))
    s.add(req(2, 28, max_tokens=30, first=100))
    outs: dict[int, list[int]] = {1: [], 2: []}
    n = 0
    while s.has_unfinished:
        b = s.schedule()
        sampled = {w.seq.seq_id: n + w.seq.seq_id for w in b.works if w.samples}
        for sid, tok in s.commit(b, sampled).new_tokens.items():
            outs[sid].append(tok)
        n += 1
    assert s.stats()["preemptions"] >= 1
    assert all(len(o) == 30 for o in outs.values())


# -- finishing, aborting, committing ---------------------------------------------------------------------------

def test_a_stop_token_or_eos_finishes_with_stop_and_max_tokens_with_length() -> None:
    s = make(eos_token_ids={0})
    s.add(req(1, 3, stop_token_ids=[5]))
    s.add(req(2, 3, first=10))
    s.add(req(3, 3, first=20, ignore_eos=True, max_tokens=2))
    b = s.schedule()
    r = s.commit(b, {1: 5, 2: 0, 3: 0})
    assert {q.seq_id: q.finish_reason for q in r.finished} == {1: "stop", 2: "stop"}
    r = s.commit(s.schedule(), {3: 0})
    assert [(q.seq_id, q.finish_reason, q.output) for q in r.finished] == [(3, "length", [0, 0])]
    assert s.stats()["free_blocks"] == 64 and s.stats()["finished"] == 3


def test_a_sequence_stops_at_max_model_len() -> None:
    s = make(max_model_len=12)
    s.add(req(1, 7, max_tokens=100))
    finished = []
    while s.has_unfinished:
        finished += s.commit(s.schedule(), {1: 3}).finished
    assert [(q.finish_reason, q.num_tokens) for q in finished] == [("length", 12)]


def test_abort_by_request_or_sequence_id_frees_the_blocks_at_once() -> None:
    s = make()
    s.add(req(1, 10))
    s.add(req(2, 10))
    step(s)
    free, held = s.stats()["free_blocks"], len(s.get("r1").block_table)
    a = s.abort("r1")
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "abort" and held == 2
    assert s.stats()["free_blocks"] == free + held and s.get("r1") is None
    assert s.abort(2).seq_id == 2 and s.abort(2) is None and s.abort("nobody") is None
    assert s.stats()["aborted"] == 2 and not s.has_unfinished


def test_a_waiting_sequence_can_be_aborted() -> None:
    s = make(max_num_seqs=1)
    s.add(req(1, 3))
    s.add(req(2, 3))
    step(s)
    assert s.abort("r2").finish_reason == "abort" and s.waiting == []


def test_a_work_aborted_between_schedule_and_commit_is_skipped() -> None:
    s = make()
    s.add(req(1, 5))
    s.add(req(2, 5))
    b = s.schedule()
    s.abort(1)
    r = s.commit(b, {1: 9, 2: 9})
    assert r.new_tokens == {2: 9} and s.get(1) is None


def test_a_batch_committed_twice_or_without_its_samples_is_refused() -> None:
    s = make()
    s.add(req(1, 5))
    b = s.schedule()
    with pytest.raises(MissingSample):
        s.commit(b, {})
    s2 = make()
    s2.add(req(1, 5))
    b = s2.schedule()
    s2.commit(b, {1: 3})
    with pytest.raises(StaleBatch):
        s2.commit(b, {1: 3})


def test_a_shared_prompt_prefix_is_not_computed_again() -> None:
    s = make()
    system = list(range(100, 117))  # 17 tokens: four full blocks
    s.add(Sequence.from_prompt(1, "a", system + [1, 2]))
    while s.has_unfinished:
        step(s)
    s.add(Sequence.from_prompt(2, "b", system + [3]))
    b = s.schedule()
    assert shape(b) == [(2, 16, 2)]
    assert s.get(2).num_cached_tokens == 16 and s.stats()["prefix_hit_tokens"] == 16


# -- deterministic mode ----------------------------------------------------------------------------------------

def chunks_of(seq_id: int, s: Scheduler, others: list[Sequence]) -> list[tuple[int, int]]:
    for o in others:
        s.add(o)
    seen = []
    while s.has_unfinished:
        b = step(s)
        seen += [(w.start, w.num_tokens) for w in b.works if w.seq.seq_id == seq_id]
    return seen


def test_deterministic_chunks_depend_only_on_the_sequence() -> None:
    alone = chunks_of(9, make(deterministic=True, max_num_batched_tokens=12), [req(9, 21, first=50)])
    crowd = [req(i, 3 + 5 * i, first=10 * i) for i in range(1, 5)]
    mixed = chunks_of(9, make(deterministic=True, max_num_batched_tokens=12), crowd + [req(9, 21, first=50)])
    assert alone == mixed == [(0, 8), (8, 8), (16, 5), (21, 1), (22, 1), (23, 1)]


def test_without_determinism_chunks_follow_the_budget() -> None:
    crowd = [req(i, 3 + 5 * i, first=10 * i) for i in range(1, 5)]
    mixed = chunks_of(9, make(max_num_batched_tokens=12), crowd + [req(9, 21, first=50)])
    assert any(start % 8 for start, n in mixed if n > 1)


def test_deterministic_prefix_hits_are_cut_to_a_chunk_boundary() -> None:
    s = make(deterministic=True)
    s.add(Sequence.from_prompt(1, "a", list(range(30))))
    while s.has_unfinished:
        step(s)
    s.add(Sequence.from_prompt(2, "b", list(range(13)) + [99, 98]))  # 3 blocks (12 tokens) cached
    assert shape(s.schedule()) == [(2, 8, 7)]  # the hit is cut to 8, a multiple of the chunk


def test_deterministic_recompute_feeds_generated_tokens_one_per_step() -> None:
    s = make(deterministic=True, prefix_caching=False)
    s.add(req(1, 6, max_tokens=10))
    for _ in range(4):
        step(s)
    seq = s.get(1)
    s._preempt(seq)  # as if blocks ran out
    starts = [shape(step(s))[0][1:] for _ in range(5)]
    assert starts == [(0, 6), (6, 1), (7, 1), (8, 1), (9, 1)]


# -- adoption --------------------------------------------------------------------------------------------------

def journal_copy(seq: Sequence) -> Sequence:
    c = Sequence(seq.seq_id, seq.request_id, list(seq.tokens), seq.prompt_len, seq.params)
    c.num_computed, c.block_table = seq.num_computed, list(seq.block_table)
    return c


def test_adopted_sequences_continue_where_they_were_with_no_recompute() -> None:
    s = make()
    s.add(req(1, 5, max_tokens=6))
    s.add(req(2, 20, max_tokens=6, first=40))
    step(s)  # 1 prefilled and sampled, 2 has its first chunk
    copies = [journal_copy(q) for q in s.running]
    succ = make()
    succ.adopt(copies)
    assert [q.status for q in succ.running] == [SeqStatus.RUNNING] * 2
    assert shape(succ.schedule()) == shape(s.schedule()) == [(1, 5, 1), (2, 8, 8)]
    assert succ.stats()["free_blocks"] == s.stats()["free_blocks"]
    succ.add(req(3, 3))
    assert succ.get(3).arrival > max(q.arrival for q in copies)


def test_adoption_refuses_an_inconsistent_journal_and_changes_nothing() -> None:
    s = make()
    s.add(req(1, 9))
    step(s)
    bad = journal_copy(s.get(1))
    bad.block_table[0] = 999
    succ = make()
    with pytest.raises(AdoptionError, match="outside"):
        succ.adopt([bad])
    assert succ.stats()["running"] == 0 and succ.stats()["free_blocks"] == 64 and bad.status is SeqStatus.WAITING


@pytest.mark.parametrize("breakage", ["finished", "computed_all", "same_request", "live"])
def test_adoption_refuses_sequences_it_cannot_run(breakage: str) -> None:
    a, b = req(1, 5), req(2, 5)
    succ = make()
    if breakage == "finished":
        a.status = SeqStatus.FINISHED
    elif breakage == "computed_all":
        a.num_computed, a.block_table = 5, [0, 1]
    elif breakage == "same_request":
        b.request_id = a.request_id
    else:
        succ.add(req(3, 3))
    with pytest.raises(AdoptionError):
        succ.adopt([a, b])
