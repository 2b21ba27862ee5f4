"""OpenAI-compatible request bodies, the chat template and OpenAI's error shape (pure logic: no I/O).

A request body becomes a `Job`: what the relay must generate (`ClientRequest`) plus what the OpenAI layer
does with the text (stop strings, streaming, usage). Invariants:
1. A body is accepted only if every field in it is one we honour: unknown fields, `n` != 1 and sampling knobs
   the engines do not have (`top_p` != 1, penalties != 0, `logprobs`, `echo`, `suffix`, `best_of` > 1) get a
   400 naming the field, never a silent no-op. Types are JSON's, strictly (as OpenAI's): `"5"` or `true` is no
   max_tokens and `"yes"` no stream; they were coerced to 5, 1 and true.
2. Errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; 4xx are
   `invalid_request_error`, 5xx `server_error`.
3. The chat template is fixed and byte-exact (the reference engines' byte-level tokenizer has no special
   tokens): one `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` (`render_chat`).
4. A prompt of more tokens than `max_context_tokens` (the router's setting: the longest context of its models) is
   refused here with OpenAI's 400 `context_length_exceeded`, never sent to an engine; one that certainly cannot
   fit is refused before its body is parsed (context_bound.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from libs.common import tokenizer
from libs.common.generate import INT64_MAX, Seed, encodable
from services.router.relay import MODEL_MAX, ClientRequest

# No max_tokens (null on a completion, none on a chat) means "until the context ends": the engine stops at its
# max_seq first (finish_reason "length"); the router does not know each engine's context length. A max_tokens
# given that the context cannot hold is refused by the engine (`strict_length`), as OpenAI refuses it.
UNBOUNDED = 1 << 30
MAX_STOPS = 4  # as OpenAI

# The engines' reasons -> OpenAI's: "eos" is the model's own end of text.
FINISH_REASONS = {"eos": "stop", "length": "length", "max_seq": "length"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Invariant 1's strict types: a JSON string, bool or float is never taken for a number or a bool.
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    include_obfuscation: bool = True  # current SDKs send it; the router's chunks carry no obfuscation field either way


class _Common(BaseModel):
    """The fields both endpoints share. Neutral values of knobs we lack are accepted (clients send them)."""

    model_config = STRICT

    model: str = Field(min_length=1, max_length=MODEL_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="none: 1.0, as OpenAI")
    seed: Seed | None = None
    n: int | None = Field(None, ge=1, le=1, description="only 1")
    top_p: float | None = Field(None, ge=1.0, le=1.0, description="only 1 (no nucleus sampling in the engines)")
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0)
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0)
    user: str | None = None  # an end-user id: accepted, not used
    # Sent by SDKs and their wrappers at these values whatever the server: accepted there, refused where they would
    # ask for something we do not do (storing the completion, another tier); metadata goes with `store` only.
    store: Literal[False] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    service_tier: Literal["auto", "default"] | None = None
    parallel_tool_calls: bool | None = None  # no tools: nothing to run in parallel
    ignore_eos: bool = False  # an extension (as vLLM's): generate past the model's end of text

    @field_validator("stop", "user")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return encodable(v)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return v

    @model_validator(mode="after")
    def _options_need_stream(self) -> _Common:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


def _prompt_kind(v: Any) -> str:
    """Which of `Prompt`'s forms a value is meant as, from its first element."""
    if isinstance(v, str):
        return "str"
    if isinstance(v, list) and v and isinstance(v[0], str):
        return "list[str]"
    return "list[list[int]]" if isinstance(v, list) and v and isinstance(v[0], list) else "list[int]"


# Validated as the one form its value is meant as: a plain union tried every form in turn, and 8 M token ids (a
# 16 MiB body) failed as `list[str]` item by item first, 2.8 s of the router's loop (each worker's only one).
Prompt = Annotated[Annotated[str, Tag("str")] | Annotated[list[str], Tag("list[str]")] |
                   Annotated[list[int], Tag("list[int]")] | Annotated[list[list[int]], Tag("list[list[int]]")],
                   Discriminator(_prompt_kind)]


class CompletionBody(_Common):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX, description="16 by default, as OpenAI")
    logprobs: None = None
    echo: Literal[False] = False
    suffix: None = None
    best_of: int | None = Field(None, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _text_prompt(cls, v: Any) -> Any:
        return encodable(v) if _prompt_kind(v) in ("str", "list[str]") else v


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _text(cls, v: str) -> str:
        return encodable(v)


class Message(BaseModel):
    """A chat message. An assistant message the client sends back as it received it (multi-turn: the official
    client's `message` object or its dump) carries the response message's other fields, null or empty from this
    router: accepted so; a refusal, tool call, function call, audio or annotation in one is refused (none is
    rendered by the chat template)."""

    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None
    refusal: None = None
    tool_calls: Annotated[list[Any], Field(max_length=0)] | None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None

    @field_validator("content", "name")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return encodable(v)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, le=INT64_MAX, description="deprecated by OpenAI for "
                                   "max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    logprobs: Literal[False] | None = None


@dataclass(frozen=True)
class Job:
    """One OpenAI request as the router runs it."""

    kind: Literal["completion", "chat"]
    request_id: str  # also the response's `id`, and the relay's request_id for the engine
    generate: ClientRequest
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    prompt_tokens: int  # counted here with the engines' tokenizer: known even when a stop string cuts the stream

    @property
    def model(self) -> str:
        return self.generate.model


def render_chat(messages: list[Message]) -> str:
    """Invariant 3. A `developer` message is a system message (OpenAI's newer name for it)."""
    lines = [f"<|{'system' if m.role == 'developer' else m.role}|>\n{m.text()}\n" for m in messages]
    return "".join(lines) + "<|assistant|>\n"


def too_long(max_context: int, tokens: int, param: str, *, exact: bool = True) -> OpenAIError:
    """Invariant 4's refusal, in OpenAI's words and code."""
    return OpenAIError(400, f"This model's maximum context length is {max_context} tokens; the {param} "
                       f"{'is' if exact else 'is at least'} {tokens} tokens.", param=param,
                       code="context_length_exceeded")


def engine_error(body: str) -> dict[str, Any] | None:
    """An engine's refusal body (`{"error": {"code", "message"}}`) as its error, or None if it is not one."""
    try:
        err = json.loads(body)["error"]
        str(err["message"])
    except (ValueError, KeyError, TypeError):
        return None
    return err if isinstance(err, dict) else None


def refusal(status: int, code: str, message: str, kind: Literal["completion", "chat"]) -> OpenAIError:
    """The relay's refusal (`RelayError`'s status, code, message) in OpenAI's shape. An engine's own refusal
    (`engine_refused`, its error body as the message) by its message; a context too long for the engine's model
    (the router's own bound, `max_context_tokens`, is the longest of all its models') as OpenAI's
    `context_length_exceeded` on the prompt or messages, which clients look for to shorten and retry."""
    if code == "engine_refused":
        err = engine_error(message)
        if err is None:
            return OpenAIError(status, message, code=code)
        message = str(err["message"])
        if err.get("code") == "context_too_long":
            return OpenAIError(status, message, param="prompt" if kind == "completion" else "messages",
                               code="context_length_exceeded")
        if err.get("code") == "max_tokens_past_context":
            return OpenAIError(status, message, param="max_tokens", code="context_length_exceeded")
    return OpenAIError(status, message, code=code)


def prompt_tokens(prompt: str | None, tokens: list[int] | None, max_context: int | None, param: str) -> int:
    """Invariant 4: the prompt's tokens (the engines' byte tokenizer), refused past `max_context`. A text longer in
    characters than the context is refused before it is tokenized (a character is at least one byte, one token):
    the encoding of a 16 MiB prompt alone was 0.7 s of the router's loop."""
    given = len(tokens or ())
    if max_context is not None and prompt is not None and len(prompt) + 1 + given > max_context:
        raise too_long(max_context, len(prompt) + 1 + given, param, exact=False)
    count = (len(tokenizer.encode(prompt)) if prompt is not None else 0) + given
    if max_context is not None and count > max_context:
        raise too_long(max_context, count, param)
    return count


def completion_job(raw: Any, max_context: int | None = None) -> Job:
    body = _parse(CompletionBody, raw)
    prompt, tokens = _prompt_of(body.prompt)
    count = prompt_tokens(prompt, tokens, max_context, "prompt")
    return _job("completion", f"cmpl-{uuid.uuid4().hex}", body, prompt, tokens, body.max_tokens, count)


def chat_job(raw: Any, max_context: int | None = None) -> Job:
    body = _parse(ChatBody, raw)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise OpenAIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt = render_chat(body.messages)
    return _job("chat", f"chatcmpl-{uuid.uuid4().hex}", body, prompt, None, limit,
                prompt_tokens(prompt, None, max_context, "messages"))


def _job(kind: Literal["completion", "chat"], request_id: str, body: _Common, prompt: str | None,
         tokens: list[int] | None, max_tokens: int | None, prompt_tokens: int) -> Job:
    gen = ClientRequest(model=body.model, prompt=prompt, tokens=tokens, max_tokens=UNBOUNDED if max_tokens is None
                        else max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                        seed=body.seed, stream=True, ignore_eos=body.ignore_eos, strict_length=max_tokens is not None)
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Job(kind, request_id, gen, stops, body.stream, include_usage, prompt_tokens)


def _prompt_of(prompt: str | list[str] | list[int] | list[list[int]]) -> tuple[str | None, list[int] | None]:
    """A string, a list of one string, token ids or a list of one list of them (validated as one form: `Prompt`):
    one prompt (n = 1)."""
    kind = _prompt_kind(prompt)
    if kind == "str":
        return str(prompt), None
    if kind in ("list[str]", "list[list[int]]"):
        if len(prompt) != 1:
            raise OpenAIError(400, "only one prompt per request is supported", param="prompt")
        if kind == "list[str]":
            return str(prompt[0]), None
        prompt = prompt[0]  # type: ignore[assignment]
    if not prompt:
        raise OpenAIError(400, "the prompt must not be empty", param="prompt")
    return None, list(prompt)  # type: ignore[arg-type]


def _parse(model: type[_Common], raw: Any) -> Any:
    """Invariant 1: a validation error becomes a 400 naming the first offending field."""
    if not isinstance(raw, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(err["loc"])
        if err["type"] == "extra_forbidden":
            raise OpenAIError(400, f"Unrecognized request argument supplied: {param}", param=param) from None
        if err["type"] == "missing":
            raise OpenAIError(400, f"Missing required parameter: '{param}'.", param=param) from None
        if param is None:  # the body as a whole (a rule across fields, or a key that is not valid Unicode)
            raise OpenAIError(400, f"Invalid request: {err['msg']}") from None
        raise OpenAIError(400, f"Invalid value for '{param}': {err['msg']}", param=param) from None


def _param(loc: tuple[int | str, ...]) -> str | None:
    """The field as a client names it (`messages.0.content`): pydantic's location without the union member it
    tried (`str`, `list[int]`, `function-after[...]`), which is no field of ours."""
    parts = [str(p) for p in loc if isinstance(p, int) or not (p in _UNION_TAGS or "[" in p)]
    return ".".join(parts) or None


_UNION_TAGS = frozenset({"str", "int", "float", "bool"})
