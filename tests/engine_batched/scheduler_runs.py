"""The fake model that random scheduler runs (hypothesis) are checked against, shared by
test_scheduler_properties.py (synchronous steps) and test_scheduler_async.py (overlapped steps).

A fake model stands in for the forward: its next token is a function of the tokens so far, and a fake KV cache
records, per slot, which prefix (and in deterministic mode which chunk shape) computed it. So the runs check
not only the bookkeeping (reference counts, budget, FCFS) but that every work reads KV that its own tokens
produced: a block shared or adopted wrongly, or overwritten while held, fails the oracle.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Self

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from engines.batched.scheduler import Batch, QueueFull, Scheduler, SchedulerConfig
from engines.batched.sequence import SamplingParams, SeqStatus, Sequence

EOS = 0
VOCAB = 4  # few token ids: prompts share prefixes and sampled tokens repeat


@dataclass
class Req:
    arrive: int  # step at which it is added
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    abort: tuple[int, bool] | None  # (step, between schedule and commit?)


@dataclass
class Scenario:
    config: SchedulerConfig
    reqs: list[Req]


@st.composite
def scenarios(draw, aborts: bool = True, pressure: bool = False) -> Scenario:
    """`pressure`: a KV cache of one max_model_len sequence and a block or two more, 4-12 requests in the first
    four steps against 2-6 running at once, a queue (max_waiting) of 1-6: preemption, queueing and refusal in
    many runs."""
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    deterministic = draw(st.booleans())
    max_model_len = draw(st.integers(8, 40))
    min_blocks = -(-max_model_len // bs)
    num_blocks = draw(st.integers(min_blocks, min_blocks + 2 if pressure else 3 * min_blocks))
    max_num_seqs = draw(st.integers(2 if pressure else 1, 6))
    budget = draw(st.integers(max(max_num_seqs, bs), 32))
    chunk = bs * draw(st.integers(1, budget // bs)) if deterministic else draw(st.integers(1, budget))
    config = SchedulerConfig(num_blocks=num_blocks, block_size=bs, prefix_caching=draw(st.booleans()),
                             max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=budget, prefill_chunk=chunk, deterministic=deterministic,
                             eos_token_ids={EOS}, max_waiting=draw(st.integers(1, 6)) if pressure else 10_000)
    systems = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=16), min_size=1, max_size=3))
    reqs = []
    for _ in range(draw(st.integers(4, 12) if pressure else st.integers(1, 10))):
        prompt = draw(st.sampled_from(systems)) + draw(st.lists(st.integers(0, VOCAB - 1), max_size=12))
        prompt = (prompt or [1])[:max_model_len - 1]
        abort = None
        if aborts and draw(st.integers(0, 4)) == 0:
            abort = (draw(st.integers(0, 30)), draw(st.booleans()))
        arrive = draw(st.integers(0, 3) if pressure else st.integers(0, 20))
        reqs.append(Req(arrive, prompt, draw(st.integers(1, 24 if pressure else 16)), draw(st.booleans()), abort))
    return Scenario(config, reqs)


def fake_next_token(tokens: list[int]) -> int:
    return hash(tuple(tokens)) % VOCAB


def prefix_ids(tokens: list[int]) -> list[int]:
    ids, h = [], 0
    for t in tokens:
        h = hash((h, t))
        ids.append(h)
    return ids


def expected_shape(seq: Sequence, p: int, chunk: int) -> tuple[int, int]:
    """Deterministic mode: the chunk that computes position p depends only on the sequence."""
    if p < seq.prompt_len:
        return p // chunk * chunk, min((p // chunk + 1) * chunk, seq.prompt_len)
    return p, p + 1


@dataclass
class Run:
    sc: Scenario
    sched: Scheduler
    kv: list[tuple[int, tuple[int, int]] | None] = field(default_factory=list)
    seqs: dict[int, Sequence] = field(default_factory=dict)
    first_scheduled: list[int] = field(default_factory=list)  # arrival orders, in order of first scheduling
    refused: set[int] = field(default_factory=set)  # requests the full queue refused (QueueFull)
    step_no: int = 0

    def __post_init__(self) -> None:
        cfg = self.sc.config
        self.kv = [None] * (cfg.num_blocks * cfg.block_size)

    @classmethod
    def fresh(cls, sc: Scenario, **kw: Any) -> Self:
        """A run of `sc` on a new scheduler of its config."""
        return cls(sc, Scheduler(sc.config), **kw)

    def compute(self, seq: Sequence, tokens: list[int], table: list[int], start: int, num_tokens: int) -> int:
        """The fake forward of one work over `tokens` (the sequence's as its step saw them) and block `table`:
        check it reads KV of its own prefix (and shape), write its positions, return the fake model's next token."""
        cfg = self.sc.config
        bs = cfg.block_size
        ids = prefix_ids(tokens)
        for p in range(start):
            cell = self.kv[table[p // bs] * bs + p % bs]
            assert cell is not None and cell[0] == ids[p], f"seq {seq.seq_id} reads foreign KV at {p}"
            if cfg.deterministic:
                assert cell[1] == expected_shape(seq, p, cfg.prefill_chunk), "KV computed in another shape"
        for p in range(start, start + num_tokens):
            self.kv[table[p // bs] * bs + p % bs] = (ids[p], (start, start + num_tokens))
        return fake_next_token(tokens)

    def forward(self, batch: Batch) -> dict[int, int]:
        """Every work computed at once (synchronous steps): the tokens sampled, by sequence."""
        sampled = {}
        for w in batch.works:
            tok = self.compute(w.seq, w.seq.tokens, w.seq.block_table, w.start, w.num_tokens)
            if w.samples:
                sampled[w.seq.seq_id] = tok
        return sampled

    def add_arrivals(self) -> None:
        for i, r in enumerate(self.sc.reqs):
            if r.arrive == self.step_no:
                seq = Sequence.from_prompt(i, f"r{i}", r.prompt,
                                           SamplingParams(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos))
                full = len(self.sched.waiting) >= self.sc.config.max_waiting
                try:
                    self.sched.add(seq)
                except QueueFull:
                    assert full, "refused with room in the queue"
                    self.refused.add(i)
                    continue
                assert not full, "queued past max_waiting"
                self.seqs[i] = seq

    def abort_due(self, between: bool) -> None:
        for i, r in enumerate(self.sc.reqs):
            if r.abort == (self.step_no, between):
                self.sched.abort(i)

    def step(self) -> None:
        self.add_arrivals()
        self.abort_due(between=False)
        check_state(self.sched)
        decoding = {s.seq_id for s in self.sched.running if s.in_decode}
        batch = self.sched.schedule()
        check_batch(self.sched, batch, decoding)
        check_state(self.sched)
        for w in batch.works:
            if w.seq.num_computed == 0 and w.seq.num_preemptions == 0 and w.seq.arrival not in self.first_scheduled:
                self.first_scheduled.append(w.seq.arrival)
        sampled = self.forward(batch)
        self.abort_due(between=True)
        self.sched.commit(batch, sampled)
        check_state(self.sched)
        self.step_no += 1

    def pending(self) -> bool:
        return self.sched.has_unfinished or any(r.arrive >= self.step_no for r in self.sc.reqs)


def check_batch(sched: Scheduler, batch: Batch, decoding: set[int]) -> None:
    cfg = sched.config
    assert batch.num_tokens <= cfg.max_num_batched_tokens
    assert len(batch) <= cfg.max_num_seqs
    assert len({w.seq.seq_id for w in batch.works}) == len(batch)
    for w in batch.works:
        assert w.seq.status is SeqStatus.RUNNING and w.start == w.seq.num_computed and w.num_tokens >= 1
        assert w.samples == (w.start + w.num_tokens == len(w.seq.tokens))
        assert len(w.seq.block_table) * cfg.block_size >= w.start + w.num_tokens
        if not w.samples or w.num_tokens > 1:
            assert w.num_tokens <= cfg.prefill_chunk
        if cfg.deterministic:
            assert (w.start, w.start + w.num_tokens) == expected_shape(w.seq, w.start, cfg.prefill_chunk)
    # Sequences that were decoding come first, each with its one token (unless preempted for blocks).
    decodes = [w.seq.seq_id in decoding for w in batch.works]
    assert decodes == sorted(decodes, reverse=True), "decode works come first"
    assert all(w.num_tokens == 1 for w in batch.works if w.seq.seq_id in decoding)
    preempted = {s.seq_id for s in batch.preempted}
    assert decoding <= {w.seq.seq_id for w in batch.works} | preempted


def check_state(sched: Scheduler) -> None:
    bm, cfg = sched.bm, sched.config
    running, waiting = sched.running, sched.waiting
    assert [s.arrival for s in running] == sorted(s.arrival for s in running)
    assert [s.arrival for s in waiting] == sorted(s.arrival for s in waiting)
    assert not {id(s) for s in running} & {id(s) for s in waiting}
    assert len(running) <= cfg.max_num_seqs
    refs: Counter[int] = Counter()
    holders: dict[int, list[tuple[Sequence, int]]] = {}
    for s in running:
        assert s.status is SeqStatus.RUNNING
        assert 0 <= s.num_computed <= len(s.tokens) - 1
        assert s.num_computed <= len(s.block_table) * cfg.block_size
        assert len(s.block_table) <= -(-len(s.tokens) // cfg.block_size)
        for j, b in enumerate(s.block_table):
            refs[b] += 1
            holders.setdefault(b, []).append((s, j))
    for s in waiting:
        assert s.status is SeqStatus.WAITING and s.block_table == [] and s.num_computed == 0
    # Reference counts are exactly the table occurrences (so never negative), and a block is free exactly
    # when no live table lists it.
    assert [bm.ref_count(b) for b in range(cfg.num_blocks)] == [refs[b] for b in range(cfg.num_blocks)]
    assert bm.num_free_blocks == cfg.num_blocks - len(refs)
    for b, hs in holders.items():
        if len(hs) > 1:  # only a shared prefix block: same index, hashed (or its holders adopted, their blocks not
            # registered yet: block_manager.py invariant 6), computed by every holder
            assert len({j for _, j in hs}) == 1
            assert bm.block_hash(b) is not None or all(s.seq_id in bm.pending for s, _ in hs)
            assert all((j + 1) * cfg.block_size <= s.num_computed for s, j in hs)


def run_to_end(run: Run, max_steps: int = 3000) -> None:
    while run.pending():
        run.step()
        assert run.step_no < max_steps, "a sequence never finished"


def check_outcomes(run: Run) -> None:
    assert not run.sched.running and not run.sched.waiting
    assert run.seqs.keys() | run.refused == set(range(len(run.sc.reqs))), "a request neither served nor refused"
    assert run.sched.bm.num_free_blocks == run.sc.config.num_blocks
    for i, seq in run.seqs.items():
        r = run.sc.reqs[i]
        assert seq.status is SeqStatus.FINISHED
        assert seq.num_output <= r.max_tokens
        if seq.finish_reason == "stop":
            assert seq.tokens[-1] == EOS and not r.ignore_eos
        elif seq.finish_reason == "length":
            assert seq.num_output == r.max_tokens or len(seq.tokens) == run.sc.config.max_model_len
        else:
            assert seq.finish_reason == "abort" and r.abort is not None
        # Every token is the fake model's continuation of the ones before it: none lost, none duplicated.
        for k in range(seq.prompt_len, len(seq.tokens)):
            assert seq.tokens[k] == fake_next_token(seq.tokens[:k])


PROPS = settings(max_examples=120, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
