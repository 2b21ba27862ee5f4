"""The batched engine's HTTP API (FastAPI on a uvicorn thread): POST /generate, POST /generate_many,
POST /abort, GET /health.

`/generate` speaks the reference engine's protocol, which the router relays: `{prompt | tokens, resume,
max_tokens, temperature, greedy, seed, stream, ignore_eos, request_id}`; streamed NDJSON lines
`{"index", "token", "text"}`, then `{"done": true, "prompt_tokens", "completion_tokens", "finish_reason",
"first_token_ms", "total_ms", "engine_id"}`. Errors: 400 (a context longer than the model's), 503 (not ready,
or the queue is full), in-band `{"done": true, "error": ...}` after the stream started. A client that goes away
aborts its sequence at once: its blocks are free for the next step.

`/generate_many` `{"requests": [body, ...]}` is many `/generate` streams in one HTTP request: the router's
resume of every stream of a dead engine at once (services/router/resume_batch.py). Why: 80 replays as 80 HTTP
requests cost this engine (and the router) 80 connections, 80 h11 parses and 80 handler tasks, taken
breadth-first by both event loops while the step thread runs: the first replay reached the handler 80-142 ms
after the router sent it (H200, 8b, 64 + 16 streams). Lines are `/generate`'s, each with `"i"`: the index of
its request in the body; a request refused alone gets a final line with its `error` and `status`; the stream
ends after every request's final line. `/abort` `{"request_id"}` ends one of them (its client went away: the
router cannot close one request of a shared connection); the connection closed ends all of them.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from engines.batched.engine import LLMEngine
from engines.batched.http_state import EngineState, FirstArrival, Sink, first_token_phases
from engines.batched.live import Request
from engines.reference.weights import served_checksum
from libs.common import tokenizer
from libs.common.generate import GenerateRequest, invalid_body

REFUSALS = {"queue_full": "the engine's queue is full; try again later",
            "bad_request": "the engine refused the request as invalid"}


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"code": code, "message": message}})


class GenerateMany(BaseModel):
    requests: list[GenerateRequest] = Field(..., min_length=1, max_length=4096)


class AbortRequest(BaseModel):
    request_id: str


class Refused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _prepare(state: EngineState, eng: LLMEngine, body: GenerateRequest) -> tuple[Request, Sink]:
    """One body checked and made a `Request` (not submitted yet); a refusal raises `Refused`."""
    ctx = tokenizer.encode(body.prompt) if body.prompt is not None else []
    ctx += list(body.tokens or []) + list(body.resume or [])
    if any(not 0 <= t < tokenizer.EOS + 1 for t in ctx):
        raise Refused(400, "bad_request", "token ids must be in [0, 257]")
    if len(ctx) + (1 if body.max_tokens else 0) > state.max_model_len:
        raise Refused(400, "context_too_long", f"the context ({len(ctx)} tokens) leaves no room in the model's "
                      f"{state.max_model_len}")
    if state.in_flight >= state.max_waiting + eng.scheduler.config.max_num_seqs:
        raise Refused(503, "queue_full", f"{state.in_flight} requests in flight; try again later")
    state.outbox.loop = asyncio.get_running_loop()
    t_received = time.perf_counter()
    sink = Sink(state.outbox)
    max_tokens = min(body.max_tokens, state.max_model_len - len(ctx))
    req = Request(request_id=body.request_id or f"req-{uuid.uuid4().hex}", context=ctx, max_tokens=max_tokens,
                  temperature=0.0 if body.greedy else body.temperature, seed=body.seed,
                  ignore_eos=body.ignore_eos, sink=sink, resumed=len(body.resume or []), t_received=t_received)
    return req, sink


async def _serving(state: EngineState) -> LLMEngine | JSONResponse:
    """The engine once it serves (held while it gets ready: `until_serving`; a recovery's first request marked on
    its timeline, and when the first one held came); else the 503."""
    await state.until_serving()
    eng = state.engine
    if eng is None or state.state != "ready":
        return _error(503, "not_ready", f"engine {state.engine_id} is {state.state}")
    rec = state.info.get("recovery")
    if rec is not None and state.t_start is not None and "first_request_ms" not in rec:
        rec["first_request_ms"] = round((time.perf_counter() - state.t_start) * 1000, 3)
        for key, at in (("first_arrival_ms", state.first_arrival), ("first_held_ms", state.first_held),
                        ("woken_ms", state.woken)):
            if at is not None:  # before its assignment: negative
                rec[key] = round((at - state.t_start) * 1000, 3)
    return eng


def build_app(state: EngineState) -> FastAPI:
    app = FastAPI(title="Holdfast batched engine")

    app.add_middleware(FirstArrival, state=state)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: object, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content=invalid_body(exc.errors()))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        eng = state.engine
        return {"ok": state.state in ("ready", "standby"), "state": state.state, "role": state.role,
                "engine_id": state.engine_id, "model": state.model, "size": state.size, "in_flight": state.in_flight,
                "engine": eng.stats() if eng else None, "first_token_phases_ms": state.phase_stats(), **state.info}

    @app.get("/checksum", response_model=None)
    async def checksum() -> Any:
        """sha256 of the weights being served (on a thread: a large model takes a while to hash)."""
        eng = state.engine
        if eng is None:
            return _error(503, "not_ready", f"engine {state.engine_id} is {state.state}")
        return await served_checksum(state.engine_id, eng.runner.w)

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, http: HTTPRequest) -> Any:
        eng = await _serving(state)
        if isinstance(eng, JSONResponse):
            return eng
        try:
            req, sink = _prepare(state, eng, body)
            req.t_arrival = getattr(http.state, "t_arrival", 0.0)
        except Refused as e:
            return _error(e.status, e.code, e.message)
        if body.max_tokens == 0:
            return _final_only(state, len(req.context), body.stream)
        resumed = list(body.resume or [])
        if body.stream:
            return StreamingResponse(_stream(state, eng, req, sink, resumed), media_type="application/x-ndjson")
        return await _collect(state, eng, req, sink, resumed)

    @app.post("/generate_many", response_model=None)
    async def generate_many(body: GenerateMany) -> Any:
        eng = await _serving(state)
        if isinstance(eng, JSONResponse):
            return eng
        return StreamingResponse(_many(state, eng, body.requests), media_type="application/x-ndjson")

    @app.post("/abort")
    async def abort(body: AbortRequest) -> dict[str, Any]:
        """End one request of a `/generate_many` stream (its own client went away)."""
        sink = state.batched_sinks.get(body.request_id)
        if sink is not None:
            sink.deliver(("done", ("aborted", 0, 0)))
        return {"aborted": sink is not None}

    return app


def _final_only(state: EngineState, prompt_tokens: int, stream: bool) -> Any:
    final = {"done": True, "prompt_tokens": prompt_tokens, "completion_tokens": 0, "finish_reason": "length",
             "first_token_ms": None, "total_ms": 0.0, "engine_id": state.engine_id}
    if stream:
        return StreamingResponse(iter([json.dumps(final) + "\n"]), media_type="application/x-ndjson")
    return {"tokens": [], "text": "", **final}


async def _events(state: EngineState, eng: LLMEngine, req: Request, sink: Sink,
                  resumed: list[int]) -> AsyncIterator[list[dict[str, Any]]]:
    """Token lines then the final line, in batches: every line the step thread handed over since the last batch
    (one wake-up of this coroutine each); aborts the sequence if the consumer goes away first."""
    t0 = time.perf_counter()
    first_ms: float | None = None
    phases: dict[str, float] = {}
    text = tokenizer.TextStream()
    text.prime(resumed)
    state.in_flight += 1
    eng.submit(req)
    done = False
    try:
        index = 0
        while True:
            batch: list[dict[str, Any]] = []
            for kind, val in await sink.take():
                if kind == "token":
                    if first_ms is None:
                        first_ms = round((time.perf_counter() - t0) * 1000, 3)
                        phases = first_token_phases(req, time.perf_counter())
                        state.phases.append(phases)
                        cb, state.on_first_token = state.on_first_token, None
                        if cb is not None:
                            cb(time.perf_counter())
                    batch.append({"index": index, "token": val, "text": text.push(val)})
                    index += 1
                    continue
                reason, prompt_tokens, completion_tokens = val
                if reason == "aborted":  # /abort: the finally aborts the sequence; no final line for nobody
                    return
                done = True
                if reason.startswith("refused:") or reason == "error":
                    code = reason.removeprefix("refused:") if reason.startswith("refused:") else "engine_error"
                    batch.append({"done": True, "engine_id": state.engine_id,
                                  "error": {"code": code, "message": REFUSALS.get(code, "the engine failed")}})
                else:
                    batch.append({"done": True, "prompt_tokens": len(req.context), "completion_tokens": index,
                                  "finish_reason": reason, "first_token_ms": first_ms,
                                  "total_ms": round((time.perf_counter() - t0) * 1000, 3),
                                  "first_token_phases_ms": phases, "engine_id": state.engine_id})
                yield batch
                return
            yield batch
    finally:
        state.in_flight -= 1
        if not done:
            eng.abort(req.request_id)


def _lines(batch: list[dict[str, Any]], tag: dict[str, int] | None = None) -> bytes:
    """A batch of lines as one write: each write is a send() that gives the interpreter up to the step thread."""
    if tag is None:
        return "".join([json.dumps(line) + "\n" for line in batch]).encode()
    return "".join([json.dumps({**tag, **line}) + "\n" for line in batch]).encode()


async def _stream(state: EngineState, eng: LLMEngine, req: Request, sink: Sink, resumed: list[int]) -> AsyncIterator[bytes]:
    async for batch in _events(state, eng, req, sink, resumed):
        yield _lines(batch)


async def _many(state: EngineState, eng: LLMEngine, bodies: list[GenerateRequest]) -> AsyncIterator[bytes]:
    """Every request's `/generate` lines in one stream, each tagged with its index `i`, in the order they come.
    Each request is submitted by its own pump task; all of them start in one pass of the event loop, so one pass
    of the step thread takes them all."""
    merged: asyncio.Queue[bytes | None] = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []

    async def pump(i: int, events: AsyncIterator[list[dict[str, Any]]]) -> None:
        try:
            async for batch in events:
                merged.put_nowait(_lines(batch, {"i": i}))
        finally:
            merged.put_nowait(None)

    for i, body in enumerate(bodies):
        try:
            req, sink = _prepare(state, eng, body)
        except Refused as e:
            yield (json.dumps({"i": i, "done": True, "status": e.status,
                               "error": {"code": e.code, "message": e.message}}) + "\n").encode()
            continue
        if body.max_tokens == 0:
            yield (json.dumps({"i": i, "done": True, "prompt_tokens": len(req.context), "completion_tokens": 0,
                               "finish_reason": "length", "first_token_ms": None, "total_ms": 0.0,
                               "engine_id": state.engine_id}) + "\n").encode()
            continue
        state.batched_sinks[req.request_id] = sink
        tasks.append(asyncio.create_task(pump(i, _events(state, eng, req, sink, list(body.resume or [])))))
    try:
        open_ = len(tasks)
        while open_:
            out = []
            chunk = await merged.get()
            while True:  # every batch queued now in one write (see _lines): a claim burst is hundreds of lines
                if chunk is None:
                    open_ -= 1
                else:
                    out.append(chunk)
                if merged.empty():
                    break
                chunk = merged.get_nowait()
            if out:
                yield b"".join(out)
    finally:  # the connection closed (or all done): every request still running is aborted by its _events
        for t in tasks:
            t.cancel()
        for body in bodies:
            if body.request_id is not None:
                state.batched_sinks.pop(body.request_id, None)


async def _collect(state: EngineState, eng: LLMEngine, req: Request, sink: Sink, resumed: list[int]) -> Any:
    tokens: list[int] = []
    text: list[str] = []
    async for batch in _events(state, eng, req, sink, resumed):
        for ev in batch:
            if not ev.get("done"):
                tokens.append(ev["token"])
                text.append(ev["text"])
            elif "error" in ev:
                code = ev["error"]["code"]
                return _error(400 if code == "bad_request" else 503, code, ev["error"]["message"])
            else:
                return {"tokens": tokens, "text": "".join(text), **ev}
    return _error(500, "engine_error", "generation ended without a result")


def warm_routes(endpoint: str) -> None:
    """The first-use costs of the HTTP path paid before anything is served, not by the first requests after a
    takeover: anyio's asyncio backend (imported by the first streamed response: ~45 ms on the CPU machine),
    FastAPI's first request to a route (it reads the endpoint's source for its error messages), the body
    model's first validation; /generate_many's too (without it, a takeover's first batched resume paid them:
11-55 ms from the router's send to the handler, H200). Both answer 503 or 422 here: nothing is served."""
    t = threading.Thread(target=anyio.run, args=(anyio.sleep, 0), name="anyio-preload")
    t.start()
    t.join()
    with httpx.Client(timeout=10) as client:
        client.get(f"{endpoint}/health")
        body = {"prompt": "", "max_tokens": 1, "stream": True}
        client.post(f"{endpoint}/generate", json=body)
        client.post(f"{endpoint}/generate_many", json={"requests": [body]})  # the router's resumes come this way
        client.post(f"{endpoint}/generate", json={"max_tokens": -1})
        client.post(f"{endpoint}/generate_many", json={"requests": [{"prompt": "", "max_tokens": 1, "stream": True}]})
        client.post(f"{endpoint}/abort", json={"request_id": ""})
