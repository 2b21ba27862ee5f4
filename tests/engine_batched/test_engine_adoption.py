"""The step loop of a successor that adopted a journal (engine.py): unclaimed adopted sequences run ahead by
ADOPTED_AHEAD tokens and then wait for their claims (the step thread leaves the interpreter to the HTTP thread
taking the router's replays); a claim gets those tokens at once and its sequence runs to its end."""

from __future__ import annotations

import threading
import time

import torch

from engines.batched.claims import ADOPTED_AHEAD
from engines.batched.engine import LLMEngine
from engines.batched.journal import Journal, JournalLayout
from engines.batched.live import Request
from engines.batched.model_runner import ModelRunner
from engines.batched.scheduler import Scheduler, SchedulerConfig
from engines.reference.config import get_config
from engines.reference.weights import load_weights, make_weights

CFG = get_config("tiny")
LAYOUT = JournalLayout(block_size=4, num_blocks=128, slots=8, max_len=256)


class ListSink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.done = threading.Event()

    def token(self, token: int) -> None:
        self.tokens.append(token)

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.done.set()


def engine(weights: dict[str, torch.Tensor], kv: torch.Tensor, jr: dict[str, torch.Tensor]) -> LLMEngine:
    runner = ModelRunner(CFG, weights, kv, LAYOUT.block_size, deterministic=True)
    sched = Scheduler(SchedulerConfig(num_blocks=LAYOUT.num_blocks, block_size=LAYOUT.block_size,
                                      max_model_len=LAYOUT.max_len, max_num_seqs=LAYOUT.slots, deterministic=True))
    return LLMEngine(runner, sched, Journal(LAYOUT, jr), adopt_claim_s=30.0)


def memory(tmp_path) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """Weights, an empty KV cache and journal: what a predecessor and its successor share."""
    weights = load_weights(make_weights(CFG, tmp_path / "tiny.safetensors", seed=4))
    kv = torch.zeros(CFG.n_layers, 2, LAYOUT.num_blocks, LAYOUT.block_size, CFG.n_kv_heads, CFG.head_dim)
    return weights, kv, {n: torch.zeros(shape, dtype=dt) for n, (dt, shape) in LAYOUT.tensors().items()}


def uninterrupted(weights: dict[str, torch.Tensor], kv: torch.Tensor, jr: dict[str, torch.Tensor], prompt: list[int],
                  max_tokens: int) -> list[int]:
    """The tokens of `prompt` run alone to its end, on a cache and journal of its own shaped like `kv` and `jr`."""
    alone = ListSink()
    ref = engine(weights, torch.zeros_like(kv), {n: torch.zeros_like(t) for n, t in jr.items()})
    ref.journal.format()
    ref.submit(Request("ref", prompt, max_tokens, 0.0, 0, True, alone))
    ref._drain()
    while not alone.done.is_set():
        ref.step()
    return alone.tokens


def test_unclaimed_adopted_sequences_wait_after_running_ahead_and_a_claim_gets_their_tokens(tmp_path) -> None:
    weights, kv, jr = memory(tmp_path)
    first = engine(weights, kv, jr)
    first.journal.format()
    prompt = [1, 5, 9, 13, 17]
    sink = ListSink()
    first.submit(Request("r1", prompt, 40, 0.0, 0, True, sink))
    first._drain()
    for _ in range(6):
        first.step()
    seen = list(sink.tokens)  # the predecessor dies here: its client has these

    succ = engine(weights, kv, jr)
    entries, dropped = succ.journal.recover()
    succ.adopt(entries, dropped)
    succ.start()
    try:
        deadline = time.monotonic() + 30
        while succ.counters.steps < ADOPTED_AHEAD and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # room for steps it should not take
        assert succ.counters.steps == ADOPTED_AHEAD
        claim = ListSink()
        succ.submit(Request("r1", prompt + seen, 40 - len(seen), 0.0, 0, True, claim, resumed=len(seen)))
        assert claim.done.wait(30)
    finally:
        succ.stop()
    assert succ.counters.claimed == 1 and succ.counters.recomputed_tokens == 0
    assert seen + claim.tokens == uninterrupted(weights, kv, jr, prompt, 40)


def test_a_new_request_joins_the_steps_only_once_every_claimed_stream_has_its_first_token(tmp_path) -> None:
    """After a takeover the late prompts' prefill does not delay the resumed streams' first token."""
    weights, kv, jr = memory(tmp_path)
    first = engine(weights, kv, jr)
    first.journal.format()
    prompts = {"r1": [1, 5, 9, 13, 17], "r2": [2, 6, 10, 14]}
    sinks = {rid: ListSink() for rid in prompts}
    for rid, p in prompts.items():
        first.submit(Request(rid, p, 40, 0.0, 0, True, sinks[rid]))
    first._drain()
    for _ in range(4):
        first.step()

    succ = engine(weights, kv, jr)
    succ.adopt(*succ.journal.recover())
    claims = {rid: ListSink() for rid in prompts}
    for rid, p in prompts.items():
        seen = sinks[rid].tokens
        succ.submit(Request(rid, p + seen, 40 - len(seen), 0.0, 0, True, claims[rid], resumed=len(seen)))
    late = ListSink()
    succ.submit(Request("late", [3, 7, 11, 15, 19, 23], 8, 0.0, 0, True, late))
    succ._drain()
    assert succ.counters.claimed == 2
    succ.step()  # decode only: each claimed stream gets its token, the late prompt waits
    assert all(len(c.tokens) == 1 for c in claims.values())
    assert succ.scheduler.stats()["waiting"] == 1 and succ.counters.prefill_tokens == 0
    succ.step()  # every resumed stream has its first token: the late prompt is admitted
    assert succ.scheduler.stats()["waiting"] == 0 and succ.counters.prefill_tokens == 6


def test_a_claims_tokens_made_ahead_are_handed_out_before_the_next_step(tmp_path) -> None:
    """A claim's tokens are there already (ADOPTED_AHEAD): they reach the HTTP side (flush) at once, not after the
    step the claim unblocks."""
    weights, kv, jr = memory(tmp_path)
    first = engine(weights, kv, jr)
    first.journal.format()
    prompt = [2, 4, 6, 8]
    sink = ListSink()
    first.submit(Request("r1", prompt, 40, 0.0, 0, True, sink))
    first._drain()
    for _ in range(5):
        first.step()
    seen = list(sink.tokens)

    succ = engine(weights, kv, jr)
    entries, dropped = succ.journal.recover()
    succ.adopt(entries, dropped)
    events: list[str] = []

    def logged(fn):  # noqa: ANN001, ANN202 - the runner's method, its arguments passed through
        def call(*args, **kw):  # noqa: ANN002, ANN003
            events.append("step")
            return fn(*args, **kw)
        return call

    succ.runner.run = logged(succ.runner.run)  # type: ignore[method-assign]  # a step alone
    succ.runner.launch = logged(succ.runner.launch)  # type: ignore[method-assign]  # an overlapped step
    claim = ListSink()
    succ.flush = lambda: events.append(f"flush:{len(claim.tokens)}")
    succ.start()
    try:
        deadline = time.monotonic() + 30
        while succ.counters.steps < ADOPTED_AHEAD and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert succ.counters.steps == ADOPTED_AHEAD
        mark = len(events)
        succ.submit(Request("r1", prompt + seen, 40 - len(seen), 0.0, 0, True, claim, resumed=len(seen)))
        assert claim.done.wait(30)
    finally:
        succ.stop()
    after = events[mark:]
    handed = next(i for i, e in enumerate(after) if e.startswith("flush:") and e != "flush:0")
    assert after[handed] == f"flush:{ADOPTED_AHEAD}" and "step" not in after[:handed]


def test_tokens_a_claim_brings_past_the_journal_are_journaled_for_a_later_successor(tmp_path) -> None:
    """A client that saw tokens the journal never committed gives them in its claim (`claim_extra_tokens`); they
    are the sequence's from then on, so they must be in its journal row too: a second successor reads them back,
    not whatever that row held at those positions."""
    weights, kv, jr = memory(tmp_path)
    prompt = [3, 7, 11, 15]
    alone = uninterrupted(weights, kv, jr, prompt, 30)  # what the client would have seen

    first = engine(weights, kv, jr)
    first.journal.format()
    first.submit(Request("r1", prompt, 30, 0.0, 0, True, ListSink()))
    first._drain()
    for _ in range(4):
        first.step()
    succ = engine(weights, kv, jr)
    entries, dropped = succ.journal.recover()
    succ.adopt(entries, dropped)
    made = len(entries[0].tokens) - len(prompt)
    seen = alone[:made + 3]  # three tokens past the journal, as the client got them
    succ.submit(Request("r1", prompt + seen, 30 - len(seen), 0.0, 0, True, ListSink(), resumed=len(seen)))
    succ._drain()
    assert succ.counters.claim_extra_tokens == 3
    succ.step()

    later = engine(weights, kv, jr)
    again, _ = later.journal.recover()
    assert len(again) == 1 and len(again[0].tokens) >= len(prompt) + len(seen)
    assert list(again[0].tokens[:len(prompt) + len(seen)]) == prompt + seen


def test_a_failed_step_loop_leaves_no_sequence_for_a_successor_to_adopt(tmp_path) -> None:
    """journal.py invariant 5: the state the journal vouches for is one that can go on. When the step loop fails
    (an exception, not a kill from outside), every row is emptied before the process exits: a request that ends
    the step loop is not adopted by each successor in turn (it comes back through the router's bounded replay)."""
    weights, kv, jr = memory(tmp_path)
    first = engine(weights, kv, jr)
    first.journal.format()
    sinks = {rid: ListSink() for rid in ("r1", "r2")}
    for i, (rid, sink) in enumerate(sinks.items()):
        first.submit(Request(rid, [1 + i, 5, 9, 13], 40, 0.0, 0, True, sink))
    first._drain()
    for _ in range(3):
        first.step()
    assert len(engine(weights, kv, jr).journal.recover()[0]) == 2  # what a successor would adopt after a kill

    def fail() -> bool:
        raise RuntimeError("simulated: a step that fails")

    first.step = first.step_overlapped = fail  # type: ignore[method-assign]
    first.start()
    deadline = time.monotonic() + 30
    while first.fatal is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert all(s.done.is_set() for s in sinks.values())  # each stream told (in-band engine_error)
    entries, _ = engine(weights, kv, jr).journal.recover()
    assert entries == []
