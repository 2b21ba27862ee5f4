"""Async scheduling in the engine (pipeline.py `step_overlapped`), on the CPU with the tiny model: step N+1 is
launched with step N's tokens still pending (fed from its device tensor), then step N is resolved. Its outputs
must be the synchronous steps' token for token (deterministic mode), and after every step the journal must be
adoptable by a successor and hold every token already streamed."""

from __future__ import annotations

import torch

from engines.batched.engine import LLMEngine
from engines.batched.live import Request
from tests.engine_batched.test_engine_adoption import ListSink, engine, memory

PROMPTS = {f"r{i}": [(7 * i + k) % 250 + 1 for k in range(3 + 5 * i)] for i in range(6)}
MAX_TOKENS = 23  # not a multiple of the block size: sequences end mid-block and at block edges


def submit_all(eng: LLMEngine) -> dict[str, ListSink]:
    sinks = {rid: ListSink() for rid in PROMPTS}
    for rid, p in PROMPTS.items():
        eng.submit(Request(rid, p, MAX_TOKENS, 0.0, 0, True, sinks[rid]))
    eng._drain()
    return sinks


def test_overlapped_steps_stream_the_synchronous_steps_tokens_and_keep_the_journal_adoptable(tmp_path) -> None:
    weights, kv, jr = memory(tmp_path)
    sync = engine(weights, torch.zeros_like(kv), {n: torch.zeros_like(t) for n, t in jr.items()})
    sync.journal.format()
    want = submit_all(sync)
    while not all(s.done.is_set() for s in want.values()):
        assert sync.step()

    eng = engine(weights, kv, jr)
    eng.journal.format()
    got = submit_all(eng)
    def successor_now() -> None:
        """A successor taking the lease over now: every committed sequence adoptable, its tokens the run's, and
        every token a client has already been sent in the journal."""
        succ = engine(weights, kv.clone(), {n: t.clone() for n, t in jr.items()})
        entries, dropped = succ.journal.recover()
        succ.adopt(entries, dropped)  # raises if a block table is inconsistent with its tokens
        assert dropped == 0
        for e in entries:
            out = e.tokens[len(PROMPTS[e.request_id]):]
            assert out == want[e.request_id].tokens[:len(out)]
            assert len(got[e.request_id].tokens) <= len(out)

    for _ in range(500):  # step_overlapped, with a death between its launch and its resolve too
        pipe = eng.pipeline
        prev = pipe.inflight
        pipe.inflight = pipe.launch(overlap=True)
        successor_now()
        if prev is not None:
            eng.counters.overlapped_steps += pipe.inflight is not None
            pipe.resolve(prev)
        elif pipe.inflight is None:
            break
        successor_now()
    assert all(s.done.is_set() for s in got.values())
    assert {r: s.tokens for r, s in got.items()} == {r: s.tokens for r, s in want.items()}
    assert eng.counters.overlapped_steps > 0 and eng.counters.tokens == sync.counters.tokens
    assert eng.scheduler.bm.num_free_blocks == eng.scheduler.config.num_blocks


def test_an_abort_while_its_step_is_in_flight_frees_its_sequence_and_the_rest_run_on(tmp_path) -> None:
    weights, kv, jr = memory(tmp_path)
    eng = engine(weights, kv, jr)
    eng.journal.format()
    sinks = submit_all(eng)
    for _ in range(4):
        eng.step_overlapped()
    eng.abort("r2")  # its work of the step in flight is dropped at the resolve
    eng._drain()
    while eng.step_overlapped():
        pass
    assert not sinks["r2"].done.is_set() and eng.counters.aborted == 1
    assert all(sinks[r].done.is_set() and len(sinks[r].tokens) == MAX_TOKENS for r in PROMPTS if r != "r2")
    assert eng.journal.free_slots() == 8 and eng.scheduler.bm.num_free_blocks == eng.scheduler.config.num_blocks


class _Order:
    """Records launches and tokens in the order they happen."""

    def __init__(self, eng: LLMEngine) -> None:
        self.events: list[str] = []
        launch = eng.runner.launch

        def logged(*args, **kw):  # noqa: ANN002, ANN003 - passes the runner's arguments through
            self.events.append("launch")
            return launch(*args, **kw)

        eng.runner.launch = logged  # type: ignore[method-assign]


def test_a_new_requests_first_token_is_handed_out_before_the_next_step_is_launched(tmp_path) -> None:
    """While others decode, a new request's first token costs its own step only: it is not held behind the host
    work of the next launch (on the CPU the whole next step; a mixed step's eager launches on a GPU)."""
    weights, kv, jr = memory(tmp_path)
    eng = engine(weights, kv, jr)
    eng.journal.format()
    submit_all(eng)
    for _ in range(3):  # every prompt in, the others decoding with a step in flight
        eng.step_overlapped()
    order = _Order(eng)

    class Marking(ListSink):
        def token(self, token: int) -> None:
            order.events.append("token")
            super().token(token)

    late = Marking()
    eng.submit(Request("late", [5, 6, 7, 8, 9], 4, 0.0, 0, True, late))
    eng._drain()
    while not late.tokens:
        assert eng.step_overlapped()
    first = order.events.index("token")
    assert order.events[:first].count("launch") == 1  # its own step's, and no later one before its token
    while eng.step_overlapped():
        pass
    assert late.done.is_set() and len(late.tokens) == 4


def test_a_request_waiting_to_be_admitted_is_launched_before_the_first_token_step_is_resolved(tmp_path) -> None:
    """A request taken in while a step that samples another's first token is in flight is not held behind that
    step: the next step (its prefill) is launched first, then the first token is handed out."""
    weights, kv, jr = memory(tmp_path)
    eng = engine(weights, kv, jr)
    eng.journal.format()
    submit_all(eng)
    for _ in range(3):
        eng.step_overlapped()
    order = _Order(eng)

    class Marking(ListSink):
        def token(self, token: int) -> None:
            order.events.append("token")
            super().token(token)

    first, second = Marking(), ListSink()
    eng.submit(Request("first", [5, 6, 7, 8, 9], 4, 0.0, 0, True, first))
    eng._drain()
    while eng.pipeline.inflight is None or not eng.pipeline.inflight.first_tokens:
        assert eng.step_overlapped()  # until the step sampling its first token is the one in flight
    assert not first.tokens
    waiting = Request("second", [9, 8, 7, 6], 4, 0.0, 0, True, second)
    eng.submit(waiting)
    eng._drain()
    assert eng.scheduler.waiting
    order.events.clear()
    assert eng.step_overlapped()
    assert order.events[:2] == ["launch", "token"]  # the waiting one's step went first, then the first token
    assert waiting.t_scheduled > 0 and first.tokens
    while eng.step_overlapped():
        pass
    assert len(first.tokens) == 4 and len(second.tokens) == 4
