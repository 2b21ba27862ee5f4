"""The generate/resume request: the body of an engine's `POST /generate`, written once for both sides.

The router sends it on every attempt of a client request (`services/router/relay.py`), a resume included; the
reference and the batched engine validate their body with it (`engines/*/server.py`). A bad body is refused by
the engine's FastAPI validation (422, which the router hands on as `engine_refused`), so the router and the
engines cannot drift apart on a field's name, type or bound.

Invariants:
1. A request has input: a prompt, tokens, or both (`give a prompt or tokens`).
2. The engine's context is `prefix()` followed by `resume`: the tokens a failed engine already generated for
   this request are fed after the prompt, so the continuation is the one the uninterrupted run would make.
3. `request_id` is the same in every attempt of one client request (the router's), so a successor that already
   holds the sequence (the batched engine) continues it instead of starting it again.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from libs.common import tokenizer

REQUEST_ID_MAX = 64


class Sampling(BaseModel):
    """What to generate and how: the fields a client and an engine attempt have in common."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, description="text; encoded with a leading BOS")
    tokens: list[int] | None = Field(None, description="token ids, appended after the encoded prompt if both are given")
    max_tokens: int = Field(64, ge=0)
    temperature: float = Field(0.0, ge=0.0, description="0: greedy")
    greedy: bool | None = Field(None, description="true forces temperature 0")
    stream: bool = False
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _has_input(self) -> Sampling:
        if self.prompt is None and not self.tokens:
            raise ValueError("give a prompt or tokens")
        return self

    def sampling_temperature(self) -> float:
        return 0.0 if self.greedy else self.temperature


class GenerateRequest(Sampling):
    """One attempt's body, as an engine receives it."""

    resume: list[int] | None = Field(None, description="tokens this request already generated elsewhere (a router "
                                     "resuming it): fed after the prompt, so the continuation is exact")
    seed: int = Field(0, description="sampling seed; with (seed, position) it fixes each sampled token")
    request_id: str | None = Field(None, max_length=REQUEST_ID_MAX, description="the router's id of the client "
                                   "request, the same in all its attempts")

    def prefix(self) -> list[int]:
        """The context before any resumed token: the encoded prompt, then the tokens."""
        ctx = tokenizer.encode(self.prompt) if self.prompt is not None else []
        return ctx + list(self.tokens or [])
