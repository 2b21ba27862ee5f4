"""EOS and `ignore_eos` in the engine (engine.py builds each sequence's stop rule), on the CPU with the tiny model:
a greedy request stops at the model's EOS unless it asked `ignore_eos`, which then runs to its `max_tokens`, in
synchronous and in overlapped (async) steps alike. (Issue 17: every request stopped at EOS, `ignore_eos` or not,
and the server's queue test got a reply of 27 of its 64 tokens whenever the one prompt of its 40 whose greedy
continuation samples EOS was among those admitted.)"""

from __future__ import annotations

import pytest

from engines.batched.engine import LLMEngine
from engines.batched.live import Request
from libs.common.tokenizer import EOS
from tests.engine_batched.test_engine_adoption import ListSink, engine, memory

# Greedy continuations of some of these sample EOS with the test weights (the test checks that some do).
PROMPTS = {f"p{i}": [(11 * i + k) % 250 + 1 for k in range(4 + i % 5)] for i in range(24)}
MAX_TOKENS = 64


class ReasonSink(ListSink):
    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.reason = reason
        super().finish(reason, prompt_tokens, completion_tokens)


def run_all(eng: LLMEngine, prompts: dict[str, list[int]], *, ignore_eos: bool, overlapped: bool) -> dict[str, ReasonSink]:
    sinks = {rid: ReasonSink() for rid in prompts}
    for rid, p in prompts.items():
        eng.submit(Request(rid, p, MAX_TOKENS, 0.0, 0, ignore_eos, sinks[rid]))
    eng._drain()
    for _ in range(10 * MAX_TOKENS):
        if not (eng.step_overlapped() if overlapped else eng.step()):
            break
    assert all(s.done.is_set() for s in sinks.values())
    return sinks


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_eos_ends_a_request_unless_it_asked_ignore_eos(tmp_path, overlapped: bool) -> None:
    weights, kv, jr = memory(tmp_path)
    eng = engine(weights, kv, jr)
    eng.journal.format()
    eng.async_schedule = overlapped
    stopped = {r: s for r, s in run_all(eng, PROMPTS, ignore_eos=False, overlapped=overlapped).items()
               if s.reason == "eos"}
    assert stopped, "no prompt's greedy continuation samples EOS: the test exercises nothing"
    for s in stopped.values():
        assert s.tokens[-1] == EOS and len(s.tokens) < MAX_TOKENS

    # The same prompts asking ignore_eos: the EOS is one more token, and they run on to max_tokens (deterministic
    # mode: each continuation is its own, whatever runs beside it).
    ignoring = run_all(eng, {r: PROMPTS[r] for r in stopped}, ignore_eos=True, overlapped=overlapped)
    for r, s in ignoring.items():
        assert (s.reason, len(s.tokens)) == ("length", MAX_TOKENS), r
        assert s.tokens[:len(stopped[r].tokens)] == stopped[r].tokens
    assert eng.scheduler.bm.num_free_blocks == eng.scheduler.config.num_blocks
