"""The batched engine's HTTP API, served by its front (front.py, a process of its own; the engine behind the link,
front_link.py): POST /generate, POST /generate_many, POST /abort, GET /health, GET /checksum.

`/generate` speaks the reference engine's protocol, which the router relays: `{prompt | tokens, resume,
max_tokens, temperature, greedy, seed, stream, ignore_eos, request_id}`; streamed NDJSON lines
`{"index", "token", "text"}`, then `{"done": true, "prompt_tokens", "completion_tokens", "finish_reason",
"first_token_ms", "total_ms", "engine_id"}` (and `text`: an unfinished last character's). Errors: 400 (a context
longer than the model's), 503 (not ready, or the queue is full), in-band `{"done": true, "error": ...}` after the
stream started; every one typed `{"error": {"code", "message"}}`, Starlette's own too (a body that is not JSON:
`bad_json`). A client that goes away aborts its sequence at once: its blocks are free for the next step. One request a `request_id` at a time: a
newer request under an id ends the older one first (its final line's error `superseded`, 409 unstreamed;
http_state.py `EngineState.run`).

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
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
import httpx
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.batched.front_link import EngineLink, Submit
from engines.batched.http_state import (
    SUPERSEDED,
    EngineState,
    FirstArrival,
    Running,
    Sink,
    first_token_phases,
)
from libs.common import tokenizer
from libs.common.generate import GenerateRequest, http_code, invalid_body
from libs.common.web.disconnect import ClosingStreamingResponse, until_disconnect
from libs.common.web.guard import RequestGuard
from libs.common.web.intake import Intake
from libs.common.web.linger import LingerStats

REFUSALS = {"queue_full": "the engine's queue is full; try again later",
            "bad_request": "the engine refused the request as invalid",
            "not_ready": "the engine is not serving",
            SUPERSEDED: "a newer request with the same request_id replaced this one"}
STATUS = {"bad_request": 400, SUPERSEDED: 409}  # a whole (not streamed) request's in-band end; else 503


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"code": code, "message": message}}, headers=headers)


class GenerateMany(BaseModel):
    requests: list[GenerateRequest] = Field(..., min_length=1, max_length=4096)


class AbortRequest(BaseModel):
    request_id: str


class Refused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _prepare(state: EngineState, link: EngineLink, body: GenerateRequest, admitted: int = 0) -> tuple[Submit, Sink]:
    """One body checked and made a `Submit` (not sent yet); a refusal raises `Refused`. The length is checked first,
    from sizes alone, and ids with the builtins' `min`/`max`: a generator over every id of a context too long for the
    model was 0.6 ms a refusal of 2k tokens, most of what a flood of them cost the streams' loop. `admitted`: the
    requests of the same `/generate_many` prepared before this one, not in flight yet (the queue's bound counts
    them: a 300-entry batch was let past it whole). A `resume` may end with the model's end of text (`ended`),
    never go past one (`past_eos`)."""
    given = (body.tokens or []) + (body.resume or [])
    ctx = (tokenizer.encode(body.prompt) if body.prompt is not None else []) + given
    if len(ctx) + (1 if body.max_tokens else 0) > state.max_model_len:
        raise Refused(400, "context_too_long", f"the context ({len(ctx)} tokens) leaves no room in the model's "
                      f"{state.max_model_len}")
    if (why := body.past_context(len(ctx), state.max_model_len)) is not None:
        raise Refused(400, "max_tokens_past_context", why)
    if given and (min(given) < 0 or max(given) > tokenizer.EOS):  # the prompt's are the tokenizer's own
        raise Refused(400, "bad_request", "token ids must be in [0, 257]")
    if (why := body.past_eos()) is not None:
        raise Refused(400, "bad_request", why)
    if state.in_flight + admitted >= state.max_waiting + link.max_num_seqs:
        raise Refused(503, "queue_full", f"{state.in_flight} requests in flight; try again later")
    max_tokens = min(body.max_tokens, state.max_model_len - len(ctx))
    sub = Submit(key=link.next_key(), request_id=body.request_id or f"req-{uuid.uuid4().hex}", context=ctx,
                 max_tokens=max_tokens, temperature=0.0 if body.greedy else body.temperature, seed=body.seed,
                 ignore_eos=body.ignore_eos, resumed=len(body.resume or []), t_arrival=0.0,
                 t_received=time.perf_counter())
    return sub, Sink()


async def _serving(state: EngineState) -> EngineLink | JSONResponse:
    """The engine once it serves (held while it gets ready: `until_serving`; the first request served hands the
    engine its marks for a recovery's timeline: when it came, when the first one held came, when the loop saw the
    engine ready); else the 503."""
    await state.until_serving()
    link = state.link
    if link is None or state.state != "ready":
        return _error(503, "not_ready", f"engine {state.engine_id} is {state.state}")
    if not state.marked:
        state.marked = True
        link.mark("first_request", time.perf_counter())
        for name, at in (("first_arrival", state.first_arrival), ("first_held", state.first_held),
                         ("woken", state.woken)):
            if at is not None:
                link.mark(name, at)
    return link


def refusal(_status: int, code: str, message: str) -> dict[str, Any]:
    """The API's error shape, for what the guard and the HTTP protocol refuse before the app (413, 408, 400)."""
    return {"error": {"code": code, "message": message}}


def front_door(app: FastAPI, state: EngineState, max_body_bytes: int, linger: LingerStats) -> RequestGuard:
    """The app as the front serves it: the guard (libs/common/web/guard.py: a body over `max_body_bytes` refused
    from its headers, or counted if chunked; HEAD served as GET), then each request's arrival marked (`FirstArrival`),
    then new requests taken a slice of the loop a pass (`Intake`: a burst of them, refusals included, runs between
    the streams' lines, not before all of them), then the API. `linger`: the protocol's counters (linger.py)."""
    intake = Intake(app, exempt=frozenset({"/health"}))  # asked by probes (the leader's of a lost node): never waits
    guard = RequestGuard(FirstArrival(intake, state), tokens=None, max_body_bytes=max_body_bytes, refusal=refusal)
    state.http_stats = lambda: {"refused": dict(guard.refused), "lingered": vars(linger), "intake": intake.stats()}
    return guard


def build_app(state: EngineState) -> FastAPI:
    app = FastAPI(title="Holdfast batched engine")

    @app.exception_handler(RequestValidationError)
    async def invalid(_: object, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content=invalid_body(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: object, exc: StarletteHTTPException) -> JSONResponse:
        """Typed like every other refusal (it was `{"detail"}`: the router passed it on as an unreadable message)."""
        return _error(exc.status_code, http_code(exc.status_code), str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(_: object, exc: Exception) -> JSONResponse:
        """What no handler above types (a bug): typed too, the failure's type only; Starlette logs the traceback."""
        return _error(500, "internal", f"internal error ({type(exc).__name__}); the engine's log has the detail")

    @app.get("/health", response_model=None)
    async def health() -> Any:
        """The engine's state, its step loop's figures and its info (asked over the link), with the front's own."""
        link = state.link
        try:
            info = dict(await link.call("health", timeout=10) or {}) if link is not None else {}
        except (TimeoutError, RuntimeError) as e:
            return JSONResponse(status_code=503, content={"ok": False, "state": state.state, "engine_id": state.engine_id,
                                                          "error": f"the engine did not answer: {e!r}"})
        engine_state = info.pop("state", state.state)
        return {"ok": engine_state in ("ready", "standby"), "state": engine_state, "role": info.pop("role", state.role),
                "engine_id": state.engine_id, "model": state.model, "size": state.size, "in_flight": state.in_flight,
                "engine": info.pop("engine", None), "first_token_phases_ms": state.phase_stats(),
                "front_requests": len(state.requests), "http": state.http_stats(), **info}

    @app.get("/checksum", response_model=None)
    async def checksum() -> Any:
        """sha256 of the weights being served (hashed by the engine on a thread of its own)."""
        if state.link is None:
            return _error(503, "not_ready", f"engine {state.engine_id} is {state.state}")
        got = await state.link.call("checksum", timeout=600)
        if "error" in got:
            return _error(503, got["error"]["code"], got["error"]["message"])
        return got

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, http: HTTPRequest) -> Any:
        link = await _serving(state)
        if isinstance(link, JSONResponse):
            return link
        try:
            sub, sink = _prepare(state, link, body)
            sub.t_arrival = getattr(http.state, "t_arrival", 0.0)
        except Refused as e:
            return _error(e.status, e.code, e.message)
        if body.max_tokens == 0 or body.ended:
            return _final_only(state, len(sub.context), body.stream, "eos" if body.ended else "length")
        resumed = list(body.resume or [])
        if body.stream:
            return ClosingStreamingResponse(_stream(state, link, sub, sink, resumed), media_type="application/x-ndjson")
        return await until_disconnect(http, _collect(state, link, sub, sink, resumed))

    @app.post("/generate_many", response_model=None)
    async def generate_many(body: GenerateMany) -> Any:
        link = await _serving(state)
        if isinstance(link, JSONResponse):
            return link
        return ClosingStreamingResponse(_many(state, link, body.requests), media_type="application/x-ndjson")

    @app.post("/abort")
    async def abort(body: AbortRequest) -> dict[str, Any]:
        """End one request of a `/generate_many` stream (its own client went away)."""
        running = state.requests.get(body.request_id)
        if running is None or not running.batched:
            return {"aborted": False}
        running.sink.deliver(("done", ("aborted", 0, 0)))
        return {"aborted": True}

    return app


def _final_line(state: EngineState, prompt_tokens: int, reason: str) -> dict[str, Any]:
    """The final line of a request that generates nothing (`max_tokens` 0, or `ended`)."""
    return {"done": True, "prompt_tokens": prompt_tokens, "completion_tokens": 0, "finish_reason": reason,
            "first_token_ms": None, "total_ms": 0.0, "engine_id": state.engine_id}


def _final_only(state: EngineState, prompt_tokens: int, stream: bool, reason: str) -> Any:
    final = _final_line(state, prompt_tokens, reason)
    if stream:
        return StreamingResponse(iter([json.dumps(final) + "\n"]), media_type="application/x-ndjson")
    return {"tokens": [], "text": "", **final}


async def _events(state: EngineState, link: EngineLink, sub: Submit, sink: Sink, resumed: list[int],
                  batched: bool = False) -> AsyncGenerator[list[dict[str, Any]], None]:
    """Token lines then the final line, in batches: every line the engine handed over since the last batch (one
    wake-up of this coroutine each); aborts the request if the consumer goes away first. `batched`: one of a
    `/generate_many`'s, which `/abort` may end."""
    t0 = time.perf_counter()
    first_ms: float | None = None
    phases: dict[str, float] = {}
    text = tokenizer.TextStream()
    text.prime(resumed)
    state.in_flight += 1
    state.run(sub.request_id, Running(sub.key, sink, batched), link)  # an older one under its id ends first
    link.submit(sub, sink)
    done = False
    try:
        index = 0
        while True:
            batch: list[dict[str, Any]] = []
            for kind, val in await sink.take():
                if kind == "first":  # the first token, with where its time went in the engine
                    now = time.perf_counter()
                    first_ms = round((now - t0) * 1000, 3)
                    phases = first_token_phases((sub.t_arrival, sub.t_received, *val[1:], now))
                    state.phases.append(phases)
                    kind, val = "token", val[0]
                if kind == "token":
                    batch.append({"index": index, "token": val, "text": text.push(val)})
                    index += 1
                    continue
                reason, prompt_tokens, completion_tokens = val
                if reason == "aborted":  # /abort: the finally aborts the request; no final line for nobody
                    return
                done = True
                code = _error_code(reason)
                if code is not None:  # its status as the front's own refusals give it (a stream's line has no other)
                    batch.append({"done": True, "engine_id": state.engine_id, "status": STATUS.get(code, 503),
                                  "error": {"code": code, "message": REFUSALS.get(code, "the engine failed")}})
                else:
                    batch.append({"done": True, "prompt_tokens": len(sub.context), "completion_tokens": index,
                                  "finish_reason": reason, "first_token_ms": first_ms,
                                  "total_ms": round((time.perf_counter() - t0) * 1000, 3),
                                  "first_token_phases_ms": phases, "engine_id": state.engine_id,
                                  **tokenizer.tail_text(text)})
                yield batch
                return
            yield batch
    finally:
        state.in_flight -= 1
        state.ended(sub.request_id, sub.key)
        if not done:
            link.abort(sub.key, sub.request_id)


def _error_code(reason: str) -> str | None:
    """The error code of a request's end, or None for a generation's own end (eos, length)."""
    if reason.startswith("refused:"):
        return reason.removeprefix("refused:")
    return {"error": "engine_error", SUPERSEDED: SUPERSEDED}.get(reason)


def _lines(batch: list[dict[str, Any]], tag: dict[str, int] | None = None) -> bytes:
    """A batch of lines as one write: one send() and one pass through uvicorn for all of them."""
    if tag is None:
        return "".join([json.dumps(line) + "\n" for line in batch]).encode()
    return "".join([json.dumps({**tag, **line}) + "\n" for line in batch]).encode()


async def _stream(state: EngineState, link: EngineLink, sub: Submit, sink: Sink, resumed: list[int]) -> AsyncIterator[bytes]:
    # closed with the response (ClosingStreamingResponse), this closes `_events` at once, which aborts the request
    async with contextlib.aclosing(_events(state, link, sub, sink, resumed)) as events:
        async for batch in events:
            yield _lines(batch)


async def _many(state: EngineState, link: EngineLink, bodies: list[GenerateRequest]) -> AsyncIterator[bytes]:
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

    try:  # from the first request on: a client gone while refusals are written leaves nothing running either
        for i, body in enumerate(bodies):
            try:
                sub, sink = _prepare(state, link, body, admitted=len(tasks))
            except Refused as e:
                yield (json.dumps({"i": i, "done": True, "status": e.status,
                                   "error": {"code": e.code, "message": e.message}}) + "\n").encode()
                continue
            if body.max_tokens == 0 or body.ended:
                final = _final_line(state, len(sub.context), "eos" if body.ended else "length")
                yield (json.dumps({"i": i, **final}) + "\n").encode()
                continue
            tasks.append(asyncio.create_task(pump(i, _events(state, link, sub, sink, list(body.resume or []),
                                                              batched=True))))
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


async def _collect(state: EngineState, link: EngineLink, sub: Submit, sink: Sink, resumed: list[int]) -> Any:
    tokens: list[int] = []
    text: list[str] = []
    async for batch in _events(state, link, sub, sink, resumed):
        for ev in batch:
            if not ev.get("done"):
                tokens.append(ev["token"])
                text.append(ev["text"])
            elif "error" in ev:
                code = ev["error"]["code"]
                return _error(STATUS.get(code, 503), code, ev["error"]["message"])
            else:
                return {**ev, "tokens": tokens, "text": "".join(text) + ev.get("text", "")}
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
