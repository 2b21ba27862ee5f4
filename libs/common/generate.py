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
4. Whatever passes validation can be served: text is valid Unicode (no lone surrogate: it must encode to
   UTF-8), a temperature is finite, a seed and max_tokens fit the journal's signed 64 bits. A body outside these
   is refused here, at the door, never by an engine's step loop (one bad request must not end an engine, and
   the router would replay it on the successor: it would end that one too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from libs.common import tokenizer

REQUEST_ID_MAX = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a journal row keeps a seed and max_tokens in 64 signed bits
# A temperature below this samples as greedy, in every engine: logits / 1e-320 overflow to inf, softmax gives NaN
# and multinomial raises in the step loop (as vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
T = TypeVar("T")


def encodable(value: T) -> T:
    """`value` (a string, or a list of them and other values) unchanged, if every string in it encodes to UTF-8;
    else ValueError. For a pydantic validator: of a field (`Text`) or, where the field is a union, of the model."""
    for text in (value if isinstance(value, list) else [value]):
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"not valid Unicode text (a lone surrogate at position {e.start})") from None
    return value


Text = Annotated[str, AfterValidator(encodable)]  # a string that encodes to UTF-8 (invariant 4)
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class Sampling(BaseModel):
    """What to generate and how: the fields a client and an engine attempt have in common. Types are JSON's,
    strictly (as the router's OpenAI routes'): `true` or `"3"` is no max_tokens and `"yes"` no stream (they were
    served as 1, 3 and a stream); an integer is a number of any kind."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Text | None = Field(None, description="text; encoded with a leading BOS")
    tokens: list[int] | None = Field(None, description="token ids, appended after the encoded prompt if both are given")
    max_tokens: int = Field(64, ge=0, le=INT64_MAX)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="0: greedy")
    greedy: bool | None = Field(None, description="true forces temperature 0")
    stream: bool = False
    ignore_eos: bool = False
    strict_length: bool = Field(False, description="refuse (400 `max_tokens_past_context`) a max_tokens the "
                                "context cannot hold, as OpenAI does, instead of ending the generation at the "
                                "context's end (finish reason `length`)")

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
    seed: Seed = Field(0, description="sampling seed; with (seed, position) it fixes each sampled token")
    request_id: Text | None = Field(None, max_length=REQUEST_ID_MAX, description="the router's id of the client "
                                   "request, the same in all its attempts")

    def prefix(self) -> list[int]:
        """The context before any resumed token: the encoded prompt, then the tokens."""
        ctx = tokenizer.encode(self.prompt) if self.prompt is not None else []
        return ctx + list(self.tokens or [])

    @property
    def ended(self) -> bool:
        """Its `resume` ends with the model's end of text (and not `ignore_eos`): the generation ended there (a stream
        cut right after its EOS line) and an engine generates nothing more (both engines generated past it, so a
        replay's output differed from the uninterrupted run's)."""
        return bool(self.resume) and not self.ignore_eos and self.resume[-1] == tokenizer.EOS  # type: ignore[index]

    def past_context(self, context_tokens: int, max_context: int) -> str | None:
        """Why an engine refuses (400 `max_tokens_past_context`) this body: `strict_length`, and its context of
        `context_tokens` (prompt, tokens and resume) with max_tokens more does not fit `max_context`. None: it fits
        or the engine may end it at the context's end. A resume keeps the sum (the router asks max_tokens less the
        tokens resumed), so the answer is the first attempt's."""
        if not self.strict_length or context_tokens + self.max_tokens <= max_context:
            return None
        resumed = len(self.resume or ())
        return (f"This model's maximum context length is {max_context} tokens; the prompt is "
                f"{context_tokens - resumed} tokens and max_tokens asks {self.max_tokens + resumed} more")

    def past_eos(self) -> str | None:
        """Why an engine refuses (400) this `resume`: it goes on past an end of text without `ignore_eos`. None: it
        does not."""
        if not self.ignore_eos and tokenizer.EOS in (self.resume or [])[:-1]:
            return "resume goes past an end of text (EOS): a generation without ignore_eos ends there"
        return None


def invalid_body(errors: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The typed refusal (422 `invalid_body`) of a body that fails this contract, from pydantic's or FastAPI's
    `errors()`: each field and what is wrong with it, never the value sent (a NaN in it cannot be written as
    JSON, and a client's own text does not belong in an error either)."""
    parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg', 'invalid')}"
             for e in errors[:5]]
    return {"error": {"code": "invalid_body", "message": "; ".join(parts) or "invalid body"}}


# Starlette's own refusals (a body it cannot read, no such route or method, a body too large), typed in the codes
# of this contract's errors: the router's and the batched engine's exception handlers answer with them.
HTTP_CODES = {400: "bad_json", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


def http_code(status: int) -> str:
    return HTTP_CODES.get(status, "error")
