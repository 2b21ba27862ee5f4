"""A sequence (one request's prompt and output) and the table of its states. Pure: no torch, no I/O.

States and who moves a sequence between them (the scheduler, through `transition`):

    WAITING   -> RUNNING      admitted: blocks allocated, first prefill chunk scheduled
    WAITING   -> FINISHED     aborted while queued
    RUNNING   -> PREEMPTED    blocks taken back (recompute): KV dropped, num_computed = 0
    RUNNING   -> FINISHED     stop token, length, or aborted
    PREEMPTED -> WAITING      put back at its place in the waiting queue (by arrival)

PREEMPTED is a transient state: the scheduler moves a preempted sequence on to WAITING in the same call, so
that a preempted sequence is queued like any other; `num_preemptions` keeps the fact. FINISHED is final.

Invariants of a sequence (checked by the scheduler and the tests):
1. `tokens = prompt + output`, `1 <= prompt_len <= len(tokens)`; tokens are only appended.
2. KV is valid for positions `[0, num_computed)`, `0 <= num_computed <= len(tokens) - 1` while it is not
   finished: the last known token is fed at the next step, whose last row samples the next token.
3. `block_table` covers at least the computed positions: `len(block_table) * block_size >= num_computed`,
   and at most the known ones: `len(block_table) <= ceil(len(tokens) / block_size)`.
4. A sequence without blocks (waiting, finished) has `num_computed == 0`.
5. Async scheduling: the last `num_pending` tokens are placeholders (`PENDING`) for tokens sampled on the
   device by a step still in flight; they are filled in order (`Scheduler.resolve`), so placeholders are only
   ever at the end, and a sequence holds at most two (the step resolved next and the one launched after it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import MappingProxyType


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


# The only moves a sequence may make; everything else is a bug in the caller.
TRANSITIONS: MappingProxyType[SeqStatus, frozenset[SeqStatus]] = MappingProxyType({
    SeqStatus.WAITING: frozenset({SeqStatus.RUNNING, SeqStatus.FINISHED}),
    SeqStatus.RUNNING: frozenset({SeqStatus.PREEMPTED, SeqStatus.FINISHED}),
    SeqStatus.PREEMPTED: frozenset({SeqStatus.WAITING}),
    SeqStatus.FINISHED: frozenset(),
})

PENDING = -1  # a placeholder token: sampled by a step in flight, not read back yet (invariant 5)

FINISH_REASONS = frozenset({"stop", "length", "abort"})


class InvalidTransition(RuntimeError):
    """A move that the status table does not allow (a broken invariant in the caller, not bad input)."""


class InvalidRequest(ValueError):
    """A request that cannot be served as given (empty prompt, bad sampling parameters)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops. `temperature == 0` is greedy; `seed` makes sampling
    reproducible per request (the model runner's business; kept here so the journal carries it)."""

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not self.temperature >= 0:
            raise InvalidRequest(f"temperature must be a number >= 0, got {self.temperature!r}")
        # Accept any iterable of ints (a list from JSON) but keep the frozen, hashable form.
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be token ids >= 0, got {sorted(self.stop_token_ids)!r}")


@dataclass(slots=True, eq=False)
class Sequence:
    """One request in the engine. Mutable, owned by the scheduler; identity is the object (eq=False)."""

    seq_id: int
    request_id: str
    tokens: list[int]
    prompt_len: int
    params: SamplingParams = field(default_factory=SamplingParams)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival: int = -1  # set by the scheduler: the order of arrival, which FCFS and preemption follow
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    num_pending: int = 0  # placeholders at the end of tokens (invariant 5)
    # Chained hashes of the full token blocks (a cache: tokens only grow, so a computed hash stays valid).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.tokens)
        if not 1 <= self.prompt_len <= len(self.tokens):
            raise InvalidRequest(f"prompt_len {self.prompt_len} outside 1..{len(self.tokens)} (empty prompt?)")

    @classmethod
    def from_prompt(cls, seq_id: int, request_id: str, prompt: list[int],
                    params: SamplingParams | None = None) -> Sequence:
        return cls(seq_id, request_id, list(prompt), len(prompt), params or SamplingParams())

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_known(self) -> int:
        """Tokens whose values are known on the host (all but the trailing placeholders)."""
        return len(self.tokens) - self.num_pending

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def in_decode(self) -> bool:
        """All known tokens but the last are computed: the next step feeds one token and samples."""
        return self.num_computed == len(self.tokens) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


def transition(seq: Sequence, to: SeqStatus) -> None:
    """Move `seq` to `to`, or raise `InvalidTransition` if the table does not allow it."""
    if to not in TRANSITIONS[seq.status]:
        raise InvalidTransition(f"sequence {seq.seq_id} ({seq.request_id!r}): {seq.status.value} -> {to.value}")
    seq.status = to
