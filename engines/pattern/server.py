"""The pattern engine's HTTP API (Starlette, no torch): the router's contract as the reference engine serves it.

- POST /generate: a `GenerateRequest` (libs/common/generate.py) answered whole (JSON) or streamed (NDJSON, one
  `{"index", "token", "text"}` line per token, then `{"done": true, "prompt_tokens", "completion_tokens",
  "finish_reason", "first_token_ms", "total_ms", "engine_id", "request_id"}`), the reference engine's shapes.
  Tokens come from `tokens.py`: a pure function of (prefix, seed, position), so a resumed request continues
  exactly. One token every `token_interval_s`, so a stream is in flight long enough to be cut by a kill.
- GET /health: state, slots, free slots, tokens generated, requests done. GET /healthz (liveness).
- GET /checksum: the sha256 of the leased memory and whether it still holds the pattern (agent mode).

Errors are typed `{"error": {"code", "message"}}`: 400 `bad_json` (not JSON), 422 `invalid_body` (the body is not
a `GenerateRequest`), 400 `bad_request` (token ids outside the vocabulary, a context that does not fit
`max_seq`), 400 `max_tokens_past_context` (a `strict_length` body whose max_tokens the context cannot hold),
503 `not_ready`. A bad body costs only its own request: the engine keeps serving the others.

Invariants: at most `slots` generations at once (the rest wait for a slot); a slot is given back when its
generation ends, fails, or its client goes away (a streamed one when the write fails or the disconnect is
seen, a whole one at the next check of `request.is_disconnected()`, every `DISCONNECT_EVERY` tokens).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engines.pattern import pattern, tokens
from libs.common.generate import GenerateRequest, invalid_body
from libs.common.tokenizer import EOS, TextStream, tail_text

VOCAB = EOS + 1  # the byte tokenizer's ids: 256 bytes, BOS, EOS
DISCONNECT_EVERY = 8


@dataclass
class PatternState:
    """What the HTTP layer serves from; the counters are touched on the serving loop only."""

    engine_id: str
    model: str = "pattern"
    slots: int = 4
    max_seq: int = 2048
    token_interval_s: float = 0.002
    seed: int = 7  # the memory pattern's
    fatal_prompt: str | None = None  # a prompt containing it ends the engine (__main__.py --fatal-prompt)
    hang_prompt: str | None = None  # a prompt containing it blocks the HTTP server for good (--hang-prompt)
    state: str = "starting"  # starting, standby, ready
    role: str = "active"
    view: np.ndarray | None = None  # the leased memory (agent mode), None without
    busy: int = 0
    tokens_generated: int = 0
    requests_done: int = 0
    _sem: asyncio.Semaphore | None = field(default=None, repr=False)

    def semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:  # created on the serving loop, on first use
            self._sem = asyncio.Semaphore(self.slots)
        return self._sem


class Refused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"code": self.code, "message": self.message}}, status_code=self.status)


def check(state: PatternState, body: GenerateRequest) -> list[int]:
    """The request's context (prefix, then resumed tokens), or `Refused` (400) when the engine cannot serve it."""
    context = body.prefix() + list(body.resume or [])
    if any(t < 0 or t >= VOCAB for t in context):
        raise Refused(400, "bad_request", f"token ids must be in [0, {VOCAB})")
    if len(context) >= state.max_seq:
        raise Refused(400, "bad_request", f"context of {len(context)} tokens does not fit max_seq {state.max_seq}")
    if (why := body.past_context(len(context), state.max_seq)) is not None:
        raise Refused(400, "max_tokens_past_context", why)
    return context


async def parse(request: Request) -> GenerateRequest:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise Refused(400, "bad_json", f"the body is not JSON: {e}") from None
    try:
        return GenerateRequest.model_validate(data)
    except ValidationError as e:
        raise Refused(422, "invalid_body", invalid_body(e.errors())["error"]["message"]) from None


async def generation(state: PatternState, body: GenerateRequest,
                     context: list[int]) -> AsyncGenerator[dict[str, Any], None]:
    """Token lines, then the final line; holds a slot throughout (invariant: given back however it ends)."""
    t0 = time.perf_counter()
    prefix = body.prefix()
    resumed = len(context) - len(prefix)
    count = max(0, min(body.max_tokens, state.max_seq - len(context)))
    reason = "length" if count == body.max_tokens else "max_seq"
    text = TextStream()
    text.prime(context)
    first_ms = 0.0
    async with state.semaphore():
        state.busy += 1
        try:
            run = tokens.run(prefix, seed=body.seed, sampled=body.sampling_temperature() > 0, resumed=resumed,
                             count=count)
            fatal = bool(state.fatal_prompt and body.prompt and state.fatal_prompt in body.prompt)
            for index, tok in enumerate(run):
                await asyncio.sleep(state.token_interval_s)  # the engine's "forward pass"
                if index == 0:
                    first_ms = (time.perf_counter() - t0) * 1000
                elif fatal:  # the batched engine's failed step loop: in-band error, then the process ends (70)
                    asyncio.get_running_loop().call_later(0.05, os._exit, 70)
                    yield {"done": True, "error": {"code": "engine_error", "message": "simulated: the step loop "
                                                   "failed on this request"}, "engine_id": state.engine_id}
                    return
                state.tokens_generated += 1
                yield {"index": index, "token": tok, "text": text.push(tok)}
            state.requests_done += 1
        finally:
            state.busy -= 1
    yield {"done": True, "prompt_tokens": len(context), "completion_tokens": count, "finish_reason": reason,
           "first_token_ms": round(first_ms, 3), "total_ms": round((time.perf_counter() - t0) * 1000, 3),
           "engine_id": state.engine_id, "request_id": body.request_id, **tail_text(text)}


async def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for line in lines:
        yield (json.dumps(line) + "\n").encode()


async def _whole(request: Request, lines: AsyncGenerator[dict[str, Any], None]) -> Response:
    toks: list[int] = []
    text: list[str] = []
    async for line in lines:
        if line.get("done"):
            return JSONResponse({**line, "tokens": toks, "text": "".join(text) + line.get("text", "")})
        toks.append(line["token"])
        text.append(line["text"])
        if len(toks) % DISCONNECT_EVERY == 0 and await request.is_disconnected():
            await lines.aclose()  # gives its slot back
            return Response(status_code=499)  # nobody reads it
    raise AssertionError("a generation ends with its final line")


def build_app(state: PatternState) -> Starlette:
    async def generate(request: Request) -> Response:
        try:
            body = await parse(request)
            if state.state != "ready":
                raise Refused(503, "not_ready", f"engine {state.engine_id} is {state.state}")
            context = check(state, body)
        except Refused as e:
            return e.response()
        if state.hang_prompt and body.prompt and state.hang_prompt in body.prompt:
            time.sleep(1e9)  # noqa: ASYNC251 - on purpose: a deadlocked server; the link thread heartbeats on
        lines = generation(state, body, context)
        if body.stream:
            return StreamingResponse(_ndjson(lines), media_type="application/x-ndjson")
        return await _whole(request, lines)

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"ok": state.state in ("ready", "standby"), "state": state.state, "role": state.role,
                             "engine_id": state.engine_id, "model": state.model, "engine": "pattern",
                             "slots": state.slots, "free_slots": state.slots - state.busy,
                             "tokens_generated": state.tokens_generated, "requests_done": state.requests_done})

    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"ok": True, "engine_id": state.engine_id})

    async def checksum(_: Request) -> JSONResponse:
        view = state.view  # hashed off the loop: a large lease takes a while
        body = {"engine_id": state.engine_id, "bytes": 0 if view is None else int(view.size),
                "sha256": None if view is None else await run_in_threadpool(pattern.checksum, view),
                "pattern_ok": None if view is None else await run_in_threadpool(pattern.matches, view, state.seed)}
        return JSONResponse(body)

    return Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health),
                             Route("/healthz", healthz), Route("/checksum", checksum)])
