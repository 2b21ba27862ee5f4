"""The router's HTTP API: POST /v1/generate (JSON or NDJSON stream), GET /stats, GET /healthz, and the
OpenAI-compatible routes (openai_api.py). Every route but `PUBLIC` needs an API key (the guard, app.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from libs.common.gc_tuning import paused_ms
from libs.common.generate import http_code, invalid_body
from libs.common.loop_watch import LoopWatch
from libs.common.web.disconnect import ClosingStreamingResponse, Gone, unless_gone, until_disconnect
from services.router import context_bound
from services.router.openai_api import openai_routes
from services.router.openai_protocol import OpenAIError, engine_error
from services.router.relay import ClientRequest, Relay, RelayError
from services.router.spare import SpareBackend
from services.router.table import EndpointTable
from services.router.workers import merge_stats

PUBLIC = frozenset({"/healthz"})  # probes: no key


def refusal(status: int, code: str, message: str) -> dict[str, Any]:
    """The guard's refusals (401, 413, 400) and the protocol's 408 in OpenAI's error shape (`OpenAIError`'s, which
    the official clients read)."""
    return OpenAIError(status, message, code="invalid_api_key" if status == 401 else code).body()


@dataclass
class Workers:
    """This worker's place among the router's workers (workers.py): its index, every worker's own `/stats` URL (none
    with one worker), and the client that asks the others."""

    index: int = 0
    stats_urls: list[str] = field(default_factory=list)
    client: httpx.AsyncClient | None = None

    async def others(self, authorization: str | None) -> list[dict[str, Any]]:
        """The other workers' own `/stats` (the caller's key passed on), each with its index; one that does not
        answer is listed with its error."""
        client = self.client
        if client is None:
            return []
        headers = {"authorization": authorization} if authorization else {}

        async def one(i: int, url: str) -> dict[str, Any]:
            try:
                r = await client.get(url, params={"scope": "worker"}, headers=headers, timeout=STATS_TIMEOUT_S)
                r.raise_for_status()
                return dict(r.json())
            except (httpx.HTTPError, ValueError) as e:
                return {"worker": i, "error": f"{type(e).__name__}: {e}"}

        return list(await asyncio.gather(*(one(i, u) for i, u in enumerate(self.stats_urls) if i != self.index)))


STATS_TIMEOUT_S = 2.0


def early_bound(max_context: int | None) -> type[APIRoute]:
    """Routes whose body's prompt is measured against `max_context` from its raw bytes before FastAPI parses it
    (context_bound.py): a /v1/generate body of 7 M token ids (14 MiB) was parsed, validated, dumped again and sent
    to the engine before the engine refused it, each of its worker's streams waiting 1.3-4.6 s (probe of
    2026-12-07); the OpenAI routes measured theirs so already. What passes is parsed as before."""

    class EarlyBound(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            parsed = super().get_route_handler()

            async def handler(request: Request) -> Response:
                if max_context is not None:
                    try:  # the body is read once: the parse below reads the same bytes
                        context_bound.refuse_early(await request.body(), max_context)
                    except OpenAIError as e:
                        return JSONResponse(status_code=e.status, content=e.body())
                return await parsed(request)

            return handler

    return EarlyBound


def build_app(relay: Relay, table: EndpointTable, ready: Callable[[], bool],
              sync: Callable[[], dict[str, Any]] = dict, watch: LoopWatch | None = None, *,
              spares: SpareBackend | None = None, workers: Workers | None = None,
              max_context: int | None = None) -> FastAPI:
    workers = workers or Workers()
    app = FastAPI(title="Holdfast reference router")
    app.include_router(openai_routes(relay, table, max_context))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        """422 `invalid_body` in OpenAI's error shape, as every other refusal of the router (it was the engines'
        `{code, message}` beside OpenAI's for a body that is not UTF-8)."""
        err = invalid_body(exc.errors())["error"]
        return JSONResponse(status_code=422, content=OpenAIError(422, err["message"], code=err["code"]).body())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own refusals (no such route, a method a route lacks, a body it cannot read) in OpenAI's error
        shape too: an OpenAI client that asks for a route the router lacks (`/v1/embeddings`) reads them."""
        return JSONResponse(status_code=exc.status_code, content=OpenAIError(exc.status_code, str(exc.detail),
                                                                             code=http_code(exc.status_code)).body(),
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        """What no handler above types (a bug): OpenAI's error shape, the failure's type only (no state in it);
        Starlette logs the traceback after this answer."""
        return JSONResponse(status_code=500, content=OpenAIError(
            500, f"internal error ({type(exc).__name__}); the router's log has the detail", code="internal").body())

    generate_routes = APIRouter(route_class=early_bound(max_context))

    @generate_routes.post("/v1/generate", response_model=None)
    async def generate(req: ClientRequest, request: Request) -> Any:
        """Its client gone (held, queued in an engine, streaming or not), the engine request is closed at once."""
        items = relay.run(req)
        try:
            first = await unless_gone(request, anext(items, None))  # held / refused: a status, not a broken stream
        except RelayError as e:
            err = engine_error(e.message) if e.code == "engine_refused" else None  # the engine's words, not its JSON
            message = e.message if err is None else str(err["message"])
            return JSONResponse(status_code=e.status, content=OpenAIError(e.status, message, code=e.code).body())
        except Gone:
            return Response(status_code=499)
        if first is None:
            return JSONResponse(status_code=502, content=OpenAIError(502, "no output", code="empty").body())
        if req.stream:
            return ClosingStreamingResponse(_ndjson(first, items), media_type="application/x-ndjson")
        return await until_disconnect(request, _collect(first, items))

    app.include_router(generate_routes)

    def own_stats() -> dict[str, Any]:
        return {**relay.stats.as_dict(), "cpu_s": round(time.process_time(), 4), "held": table.held(),
                "endpoints": table.describe(), "recoveries": table.recoveries(), "sync": sync(), "route_ins": relay.route_ins.recent(),
                "resume_batches": relay.resumes.stats(), "reach_checks": relay.reach.checks,
                "loop_late": watch.recent() if watch is not None else None,
                "gc_paused_ms": round(paused_ms(), 1), "gc_frozen": gc.get_freeze_count(),
                "spare_connections": spares.stats() if spares is not None else None, "worker": workers.index,
                "pid": os.getpid()}

    @app.get("/stats")
    async def stats(request: Request, scope: Literal["router", "worker"] = "router") -> dict[str, Any]:
        """The whole router's (every worker's merged: workers.py `merge_stats`), or with `scope=worker` this
        worker's alone."""
        own = own_stats()
        if scope == "worker" or not workers.stats_urls:
            return own
        others = await workers.others(request.headers.get("authorization"))
        merged = merge_stats([own, *(o for o in others if "error" not in o)])
        merged["workers"] = [{"worker": w.get("worker"), "url": workers.stats_urls[w["worker"]],
                              **({"error": w["error"]} if "error" in w else
                                 {k: w.get(k) for k in ("pid", "requests", "in_flight", "lines", "cpu_s")})}
                             for w in sorted([own, *others], key=lambda w: w.get("worker", 0))]
        return merged

    @app.get("/healthz", response_model=None)
    async def healthz() -> Any:
        ok = ready()
        body = {"ok": ok, "models": {m: len(eps) for m, eps in table.describe().items()}}
        return body if ok else JSONResponse(status_code=503, content=body)

    return app


async def _ndjson(first: dict[str, Any], rest: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(rest):  # the response closes this generator, this one the relay's
        yield (json.dumps(first) + "\n").encode()
        async for item in rest:
            yield (json.dumps(item) + "\n").encode()


async def _collect(first: dict[str, Any], rest: AsyncGenerator[dict[str, Any], None]) -> Any:
    tokens: list[int] = []
    text: list[str] = []
    item: dict[str, Any] | None = first
    async with contextlib.aclosing(rest):
        while item is not None:
            if item.get("done"):
                if "error" in item:
                    return JSONResponse(status_code=502, content={**item, "tokens": tokens, "text": "".join(text)})
                return {**item, "tokens": tokens, "text": "".join(text) + item.get("text", "")}
            tokens.append(item["token"])
            text.append(item.get("text", ""))
            item = await anext(rest, None)
    return JSONResponse(status_code=502, content=OpenAIError(502, "no final line", code="truncated").body())
