"""The step thread's sequences and the requests they serve: `Request` (what the HTTP layer hands in), `Sink`
(where its output goes), `Live` (a sequence the engine serves) and `LiveSet`, the one table of them that the
step loop (engine.py), the step pipeline (pipeline.py) and the claims of adopted sequences (claims.py) share.
No torch here: the journal is only told which rows to release.

Invariants of a `LiveSet`:
1. A sequence is in `live` from its admission (or adoption) until it leaves; `by_request` maps a request id to
   the newest of its sequences still live; `orphans` is the subset adopted and not claimed yet.
2. A live sequence holds a journal row (`slot`) only while it runs: a row is released when the sequence leaves,
   is preempted, or ends unclaimed, and never twice (`slot` is None once released).
3. `resuming` holds adopted sequences with no token sent since their claim; while it is non-empty (and for at
   most RESUME_FIRST_S after the adoption, claims.py) no new request is admitted into a step.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engines.batched.sequence import SamplingParams, Sequence
from libs.common.generate import SAMPLING_EPS
from libs.common.tokenizer import EOS

if TYPE_CHECKING:
    from engines.batched.journal import Journal

STOP = frozenset({EOS})
REFUSED_FULL, REFUSED_BAD = "refused:queue_full", "refused:bad_request"  # finish reasons of a refused request


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
    t_arrival: float = 0.0  # its head came to the ASGI app (http_state.FirstArrival), before its body was parsed
    t_received: float = 0.0  # the HTTP handler had it (set there)
    t_submit: float = 0.0
    t_intake: float = 0.0
    t_scheduled: float = 0.0
    t_first_token: float = 0.0


@dataclass
class Live:
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
    # tokens a resumed client had seen past what its adopted sequence held at adoption: 0 from a journal (a token is
    # streamed after its commit); from a KV backup (backup.py), the lag's tokens, made again (decoded ahead, or fed)
    claim_past_adopted_tokens: int = 0
    recomputed_tokens: int = 0  # context of replayed requests this engine did not hold: prefilled again
    journal_dropped: int = 0
    unjournaled: int = 0
    overlapped_steps: int = 0  # steps launched while the previous one was in flight
    dropped_rows: int = 0  # rows of sequences that had already stopped (async scheduling's one extra)


def request_params(max_tokens: int, temperature: float, seed: int, ignore_eos: bool) -> SamplingParams:
    """A request's sampling and stop rule: EOS ends it unless it asked `ignore_eos`. A stop token ends a sequence
    whatever `ignore_eos` says (scheduler.py `_stop_reason`), so EOS is one only for a request that stops at it
    (issue 17: with EOS always a stop token, an `ignore_eos` request ended at its first EOS)."""
    temperature = 0.0 if temperature < SAMPLING_EPS else temperature  # greedy, on the greedy path
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          stop_token_ids=frozenset() if ignore_eos else STOP, ignore_eos=ignore_eos)


def finish_reason(seq: Sequence) -> str:
    reason = seq.finish_reason or "length"
    return "eos" if reason == "stop" else reason


class LiveSet:
    """The live sequences, by sequence id and by request id (invariants in the module docstring)."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.live: dict[int, Live] = {}  # seq_id -> live sequence
        self.by_request: dict[str, int] = {}
        self.orphans: dict[int, Live] = {}  # adopted, not claimed yet
        self.resuming: set[int] = set()  # adopted, no token sent since its claim yet (RESUME_FIRST_S)
        self.resume_until = 0.0
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    def release(self, live: Live) -> None:
        """Its journal row given up (it left, was preempted, or ended unclaimed)."""
        if live.slot is not None:
            self.journal.release(live.slot)
            live.slot = None

    def leave(self, live: Live) -> None:
        self.resuming.discard(live.seq.seq_id)
        self.live.pop(live.seq.seq_id, None)
        if self.by_request.get(live.seq.request_id) == live.seq.seq_id:
            del self.by_request[live.seq.request_id]
        self.release(live)

    def admitting(self) -> bool:
        """New requests join steps again once every resumed stream has its first token after the failover."""
        if self.resuming and time.perf_counter() > self.resume_until:
            self.resuming.clear()
        return not self.resuming
