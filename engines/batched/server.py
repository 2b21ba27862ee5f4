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
import collections
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from engines.batched.engine import LLMEngine
from engines.batched.live import Request
from engines.reference.weights import served_checksum
from libs.common import tokenizer
from libs.common.generate import GenerateRequest, invalid_body

HOLDING = frozenset({"standby", "loading"})  # states a request is held in (EngineState.until_serving); not
# "starting": warm_routes's request (its 503 is the point) comes then
REFUSALS = {"queue_full": "the engine's queue is full; try again later",
            "bad_request": "the engine refused the request as invalid"}


class EngineState:
    def __init__(self, engine_id: str, model: str, size: str, max_model_len: int, max_waiting: int) -> None:
        self.engine_id, self.model, self.size = engine_id, model, size
        self.max_model_len, self.max_waiting = max_model_len, max_waiting
        self.state = "starting"  # starting, loading, standby, ready, stopping
        self.role = "active"
        self.engine: LLMEngine | None = None
        self.in_flight = 0
        self.info: dict[str, Any] = {}
        self.on_first_token: Callable[[float], None] | None = None
        self.outbox = Outbox()
        self.t_start: float | None = None  # perf_counter of a recovery's start (its assignment, or the process's)
        self.batched_sinks: dict[str, _Sink] = {}  # request id -> sink, of requests streamed by /generate_many
        self.phases: collections.deque[dict[str, float]] = collections.deque(maxlen=256)  # recent first tokens'
        # A request that comes before the engine serves (a standby the router was told will take over:
        # EndpointRemoved.successor_id) waits up to `hold_s` for it, `held` at a time at most `max_waiting`.
        self.hold_s = 0.0
        self.held = 0
        self.first_held: float | None = None  # perf_counter of the first request held
        self.first_arrival: float | None = None  # perf_counter of the first POST's headers once not starting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

    def become(self, new: str) -> None:
        """Any thread: the engine's state changes; held requests look again. The state is written before the loop
        is read, and `until_serving` sets the loop before it reads the state: a change is never missed."""
        self.state = new
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def until_serving(self) -> None:
        """Hold a request while the engine is not serving yet (HOLDING), at most `hold_s`."""
        if self.state not in HOLDING or self.hold_s <= 0 or self.held >= self.max_waiting:
            return
        loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_s
        self.held += 1
        if self.first_held is None:
            self.first_held = time.perf_counter()
        try:
            while True:
                if self._changed is None:
                    self._changed = asyncio.Event()
                changed = self._changed
                left = deadline - loop.time()
                if self.state not in HOLDING or left <= 0:
                    return
                try:
                    await asyncio.wait_for(changed.wait(), left)
                except TimeoutError:
                    return
        finally:
            self.held -= 1

    def phase_stats(self) -> dict[str, dict[str, float]]:
        """Where recent requests' first-token time went (ms, p50 / max per phase: `PHASES`), for /health."""
        out = {}
        for name in PHASES:
            vals = sorted(p[name] for p in self.phases if name in p)
            if vals:
                out[name] = {"n": len(vals), "p50": vals[len(vals) // 2], "max": vals[-1]}
        return out


# A request's way to its first token (ms each, from engine.Request's timestamps and the first line's write):
# received -> submitted (the response started, the request handed to the step thread) -> taken in by the step
# thread -> first launched in a step -> first token handed to its sink -> first token line yielded for writing.
PHASES = ("to_submit", "queued", "to_scheduled", "to_token", "to_write")


def first_token_phases(req: Request, t_written: float) -> dict[str, float]:
    marks = (req.t_received, req.t_submit, req.t_intake, req.t_scheduled, req.t_first_token, t_written)
    return {name: round((b - a) * 1000, 2) for name, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True) if a and b}


class Outbox:
    """The step thread's output for every request, handed to the HTTP loop once a pass (`flush`), not once a
    token: with 64 streams a wake-up per token was 6,400 a second, each taking the interpreter from the step
    thread. Items keep their order (one deque); `flush` schedules at most one drain at a time."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._items: collections.deque[tuple[asyncio.Queue[tuple[str, Any]], tuple[str, Any]]] = collections.deque()
        self._scheduled = False

    def put(self, q: asyncio.Queue[tuple[str, Any]], item: tuple[str, Any]) -> None:
        self._items.append((q, item))

    def flush(self) -> None:  # step thread
        if self._items and not self._scheduled and self.loop is not None:
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # HTTP loop; cleared before taking, so a put after it is taken or flushed again
        self._scheduled = False
        while self._items:
            q, item = self._items.popleft()
            q.put_nowait(item)


class _Sink:
    """Hands the step thread's output to one request's coroutine, through the outbox."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def token(self, token: int) -> None:
        self.outbox.put(self.q, ("token", token))

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.outbox.put(self.q, ("done", (reason, prompt_tokens, completion_tokens)))


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


def _prepare(state: EngineState, eng: LLMEngine, body: GenerateRequest) -> tuple[Request, _Sink]:
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
    sink = _Sink(state.outbox)
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
        for key, at in (("first_arrival_ms", state.first_arrival), ("first_held_ms", state.first_held)):
            if at is not None:  # before its assignment: negative
                rec[key] = round((at - state.t_start) * 1000, 3)
    return eng


class FirstArrival:
    """Marks when the first POST came once the engine stood by or took over (its headers, before FastAPI reads and
    parses its body): a recovery's timeline tells the way to the engine from the engine's own parsing. A plain ASGI
    wrapper: nothing added to a streamed response's path."""

    def __init__(self, app: Any, state: EngineState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        state = self.state
        if state.first_arrival is None and scope["type"] == "http" and scope["method"] == "POST" \
                and state.state != "starting":
            state.first_arrival = time.perf_counter()
        await self.app(scope, receive, send)


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
    async def generate(body: GenerateRequest) -> Any:
        eng = await _serving(state)
        if isinstance(eng, JSONResponse):
            return eng
        try:
            req, sink = _prepare(state, eng, body)
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
            sink.q.put_nowait(("done", ("aborted", 0, 0)))
        return {"aborted": sink is not None}

    return app


def _final_only(state: EngineState, prompt_tokens: int, stream: bool) -> Any:
    final = {"done": True, "prompt_tokens": prompt_tokens, "completion_tokens": 0, "finish_reason": "length",
             "first_token_ms": None, "total_ms": 0.0, "engine_id": state.engine_id}
    if stream:
        return StreamingResponse(iter([json.dumps(final) + "\n"]), media_type="application/x-ndjson")
    return {"tokens": [], "text": "", **final}


async def _events(state: EngineState, eng: LLMEngine, req: Request, sink: _Sink, resumed: list[int]) -> AsyncIterator[dict[str, Any]]:
    """Token lines then the final line; aborts the sequence if the consumer goes away first."""
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
            kind, val = await sink.q.get()
            if kind == "token":
                if first_ms is None:
                    first_ms = round((time.perf_counter() - t0) * 1000, 3)
                    phases = first_token_phases(req, time.perf_counter())
                    state.phases.append(phases)
                    cb, state.on_first_token = state.on_first_token, None
                    if cb is not None:
                        cb(time.perf_counter())
                yield {"index": index, "token": val, "text": text.push(val)}
                index += 1
                continue
            reason, prompt_tokens, completion_tokens = val
            if reason == "aborted":  # /abort: the finally aborts the sequence; no final line for nobody
                return
            done = True
            if reason.startswith("refused:") or reason == "error":
                code = reason.removeprefix("refused:") if reason.startswith("refused:") else "engine_error"
                yield {"done": True, "error": {"code": code, "message": REFUSALS.get(code, "the engine failed")},
                       "engine_id": state.engine_id}
                return
            yield {"done": True, "prompt_tokens": len(req.context), "completion_tokens": index, "finish_reason": reason,
                   "first_token_ms": first_ms, "total_ms": round((time.perf_counter() - t0) * 1000, 3),
                   "first_token_phases_ms": phases, "engine_id": state.engine_id}
            return
    finally:
        state.in_flight -= 1
        if not done:
            eng.abort(req.request_id)


async def _stream(state: EngineState, eng: LLMEngine, req: Request, sink: _Sink, resumed: list[int]) -> AsyncIterator[bytes]:
    """Lines already queued go out in one write (a claim's tokens made ahead, a pass's tokens): each write is a
    send() that gives the interpreter up to the step thread, and takes a switch interval to get it back."""
    out: list[str] = []
    async for line in _events(state, eng, req, sink, resumed):
        out.append(json.dumps(line) + "\n")
        if sink.q.empty():
            yield "".join(out).encode()
            out.clear()
    if out:
        yield "".join(out).encode()


async def _many(state: EngineState, eng: LLMEngine, bodies: list[GenerateRequest]) -> AsyncIterator[bytes]:
    """Every request's `/generate` lines in one stream, each tagged with its index `i`, in the order they come.
    Each request is submitted by its own pump task; all of them start in one pass of the event loop, so one pass
    of the step thread takes them all."""
    merged: asyncio.Queue[bytes | None] = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []

    async def pump(i: int, events: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for line in events:
                merged.put_nowait((json.dumps({"i": i, **line}) + "\n").encode())
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
            line = await merged.get()
            while True:  # every line queued now in one write (see _stream): a claim burst is hundreds of lines
                if line is None:
                    open_ -= 1
                else:
                    out.append(line)
                if merged.empty():
                    break
                line = merged.get_nowait()
            if out:
                yield b"".join(out)
    finally:  # the connection closed (or all done): every request still running is aborted by its _events
        for t in tasks:
            t.cancel()
        for body in bodies:
            if body.request_id is not None:
                state.batched_sinks.pop(body.request_id, None)


async def _collect(state: EngineState, eng: LLMEngine, req: Request, sink: _Sink, resumed: list[int]) -> Any:
    tokens: list[int] = []
    text: list[str] = []
    async for ev in _events(state, eng, req, sink, resumed):
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

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
