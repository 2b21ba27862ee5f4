"""The engine's HTTP API (FastAPI): POST /generate (JSON or streamed NDJSON), GET /health.

Streaming lines: one object per token `{"index", "token", "text"}`, then a final
`{"done": true, "prompt_tokens", "completion_tokens", "finish_reason", "first_token_ms", "total_ms", "engine_id"}`
(and `text`: an unfinished last character's, libs/common/tokenizer.py `flush`).
An error after the stream started is a final `{"done": true, "error": {code, message}}` line.

Each request runs its generation on a thread of its own that hands tokens to the event loop, so a client
that goes away stops the generation after at most one more forward pass and frees its KV slot.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from engines.reference.engine import BadRequest, EngineCore, Finished, GenerationRequest, TokenOut
from engines.reference.weights import served_checksum
from libs.common.generate import GenerateRequest, invalid_body


def _generation(body: GenerateRequest) -> GenerationRequest:
    """The engine core's request: the context is the prefix, then the resumed tokens (libs/common/generate.py)."""
    prefix = body.prefix()
    return GenerationRequest(context=prefix + list(body.resume or []), max_tokens=body.max_tokens,
                             temperature=body.sampling_temperature(), seed=body.seed, ignore_eos=body.ignore_eos,
                             prefix_len=len(prefix), ended=body.ended)


class EngineState:
    """What the HTTP layer serves from; `core` is None until the model is built (loading, standby)."""

    def __init__(self, engine_id: str, model: str, size: str) -> None:
        self.engine_id = engine_id
        self.model = model
        self.size = size
        self.state = "starting"  # starting, loading, standby, ready, stopping
        self.role = "active"
        self.core: EngineCore | None = None
        self.sem: asyncio.Semaphore | None = None
        self.info: dict[str, Any] = {}  # memory source, timings, recovery figures (shown in /health)
        self.on_first_token: Callable[[float], None] | None = None  # called once, with time.perf_counter()
        self.on_first_request: Callable[[float], None] | None = None  # likewise, when a generation arrives

    def install(self, core: EngineCore) -> None:
        self.core = core
        self.sem = None  # created lazily on the serving loop

    def _semaphore(self) -> asyncio.Semaphore:
        assert self.core is not None
        if self.sem is None:
            self.sem = asyncio.Semaphore(self.core.slots)
        return self.sem


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"code": code, "message": message}})


async def _run_generation(core: EngineCore, req: GenerationRequest) -> AsyncIterator[TokenOut | Finished]:
    """Step `core.generate` on a worker thread; stop it (and free its slot) if the consumer goes away."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[TokenOut | Finished | BaseException | None] = asyncio.Queue()
    stop = threading.Event()

    def work() -> None:
        core.mark("thread_started")
        it = core.generate(req)
        try:
            for ev in it:
                loop.call_soon_threadsafe(q.put_nowait, ev)
                if stop.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which reports it
            loop.call_soon_threadsafe(q.put_nowait, e)
        finally:
            it.close()
            loop.call_soon_threadsafe(q.put_nowait, None)

    core.mark("thread_starting")
    threading.Thread(target=work, name="generate", daemon=True).start()
    try:
        while True:
            item = await q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def preload_streaming() -> None:
    """Starlette's StreamingResponse opens an anyio task group on its first use, which imports anyio's asyncio
    backend then: 45 ms on the CPU machine, on the first streamed request after a takeover (stall_watch.py
    caught the HTTP thread in the import). One throwaway anyio run imports it at start instead (on a thread of
    its own: the caller may be inside an event loop already)."""
    t = threading.Thread(target=anyio.run, args=(anyio.sleep, 0), name="anyio-preload")
    t.start()
    t.join()


def warm_routes(endpoint: str) -> None:
    """One request to each route before anything is served: FastAPI reads and tokenizes an endpoint's source
    file on the route's first request (`inspect.getsourcelines`, for its error messages), which would otherwise
    land on a successor's first request after a takeover (stall_watch.py caught the HTTP thread in
    `tokenize.open`, ~9 ms before the handler, on the CPU). Nothing is served yet: /generate answers 503 (or
    400 for the empty prompt), after FastAPI has done its first-request work and validated the body."""
    with httpx.Client(timeout=10) as client:
        client.get(f"{endpoint}/health")
        client.post(f"{endpoint}/generate", json={"prompt": "", "max_tokens": 0, "stream": True})


class ArrivalMark:
    """Marks `arrived` (EngineCore.mark) when a request's headers are parsed, before FastAPI reads and validates
    its body: a traced first generation then tells the HTTP server's share of the wait from FastAPI's."""

    def __init__(self, app: Any, state: EngineState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        core = self.state.core
        if core is not None and scope["type"] == "http" and scope["path"] == "/generate":
            core.mark("arrived")
        await self.app(scope, receive, send)


def build_app(state: EngineState) -> FastAPI:
    preload_streaming()
    app = FastAPI(title="Holdfast reference engine")
    app.add_middleware(ArrivalMark, state=state)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content=invalid_body(exc.errors()))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        core = state.core
        return {
            "ok": state.state in ("ready", "standby"), "state": state.state, "role": state.role,
            "engine_id": state.engine_id, "model": state.model, "size": state.size,
            "device": str(core.model.device) if core else None,
            "slots": core.slots if core else 0, "free_slots": core.free_slots() if core else 0,
            "tokens_generated": core.tokens_generated if core else 0,
            "requests_done": core.requests_done if core else 0,
            "kv_reused": core.kv_reuse() if core else None, **state.info,
        }

    @app.get("/checksum")
    async def checksum() -> Any:
        """sha256 of the weights being served (on a thread: a large model takes a while to hash)."""
        core = state.core
        if core is None:
            return _error(503, "not_ready", f"engine {state.engine_id} is {state.state}")
        return await served_checksum(state.engine_id, core.model.w)

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateRequest) -> Any:
        core = state.core
        if core is None or state.state != "ready":
            return _error(503, "not_ready", f"engine {state.engine_id} is {state.state}")
        core.mark("handler")
        req = _generation(body)
        cb, state.on_first_request = state.on_first_request, None
        if cb is not None:
            cb(time.perf_counter())
        try:
            if (why := body.past_eos()) is not None:
                raise BadRequest(why)
            core.validate(req)
        except BadRequest as e:
            return _error(400, "bad_request", str(e))
        if (why := body.past_context(len(req.context), core.max_seq)) is not None:
            return _error(400, "max_tokens_past_context", why)
        sem = state._semaphore()
        if body.stream:
            return StreamingResponse(_stream(core, req, sem), media_type="application/x-ndjson")
        return await _collect(core, req, sem)

    def _final(ev: Finished) -> dict[str, Any]:
        return {"done": True, "prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                "finish_reason": ev.finish_reason, "first_token_ms": ev.first_token_ms, "total_ms": ev.total_ms,
                "engine_id": state.engine_id, **({"text": ev.text} if ev.text else {})}

    def _note_first_token() -> None:
        cb, state.on_first_token = state.on_first_token, None
        if cb is not None:
            cb(time.perf_counter())

    async def _stream(core: EngineCore, req: GenerationRequest, sem: asyncio.Semaphore) -> AsyncIterator[bytes]:
        async with sem:
            try:
                async for ev in _run_generation(core, req):
                    if isinstance(ev, TokenOut):
                        _note_first_token()
                        line = {"index": ev.index, "token": ev.token, "text": ev.text}
                    else:
                        line = _final(ev)
                    yield (json.dumps(line) + "\n").encode()
            except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
                err = {"done": True, "error": {"code": "engine_error", "message": f"{type(e).__name__}: {e}"},
                       "engine_id": state.engine_id}
                yield (json.dumps(err) + "\n").encode()

    async def _collect(core: EngineCore, req: GenerationRequest, sem: asyncio.Semaphore) -> Any:
        tokens: list[int] = []
        text: list[str] = []
        async with sem:
            try:
                async for ev in _run_generation(core, req):
                    if isinstance(ev, TokenOut):
                        _note_first_token()
                        tokens.append(ev.token)
                        text.append(ev.text)
                    else:
                        return {**_final(ev), "tokens": tokens, "text": "".join(text) + ev.text}
            except Exception as e:  # noqa: BLE001
                return _error(500, "engine_error", f"{type(e).__name__}: {e}")
        return _error(500, "engine_error", "generation ended without a result")

    return app
