"""The OpenAI-compatible HTTP API: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

A body becomes a `Job` (openai_protocol.py), runs through the relay (so an engine failure is replayed on a
successor underneath, invisibly), its text goes through the stop strings (stop_scan.py) and out in OpenAI's
shapes (openai_format.py). Invariants:
1. Status before content: an error up to the first piece of text (bad body 400, unknown model 404, no
   engine or queue full 503, engines failed 502, an engine's refusal with its 4xx) is a status and OpenAI's
   error body; after it, one `data: {"error": ...}` event ends the stream (no `[DONE]`).
2. A stop string ends the request: the text stops before it, finish_reason "stop", and the engine request is
   closed at once (`Relay.enough`, then the relay's generator closed). A client that goes away closes it too,
   whenever it goes: held in the router, queued in an engine before its first token, streaming or not.
3. `id` is the relay's `request_id`, the one every engine attempt of this request was sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from libs.common.web.disconnect import ClosingStreamingResponse, Gone, unless_gone, until_disconnect
from services.router import context_bound
from services.router import openai_format as fmt
from services.router.openai_protocol import (
    FINISH_REASONS,
    Job,
    OpenAIError,
    chat_job,
    completion_job,
    refusal,
)
from services.router.relay import Relay, RelayError
from services.router.stop_scan import StopScanner
from services.router.table import EndpointTable


@dataclass(frozen=True)
class End:
    finish_reason: str
    completion_tokens: int  # tokens the engines generated for it (with a stop string: up to the match)
    error: OpenAIError | None = None


def openai_routes(relay: Relay, table: EndpointTable, max_context: int | None = None) -> APIRouter:
    """`max_context`: the longest context of the models behind the router; a longer prompt is refused here
    (openai_protocol.py invariant 4)."""
    api = APIRouter()
    started = int(time.time())

    def model(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started, "owned_by": "holdfast"}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model(m) for m in table.known()]}

    @api.get("/v1/models/{name:path}", response_model=None)
    async def one_model(name: str) -> Any:
        """What `client.models.retrieve(name)` asks: the model, or OpenAI's 404."""
        if name not in table.known():
            e = OpenAIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
            return JSONResponse(status_code=404, content=e.body())
        return model(name)

    @api.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response | dict[str, Any]:
        return await serve(request, completion_job)

    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response | dict[str, Any]:
        return await serve(request, chat_job)

    async def serve(request: Request, parse: Callable[[Any, int | None], Job]) -> Response | dict[str, Any]:
        try:
            _json_content(request.headers.get("content-type"))
            body = await request.body()
            if max_context is not None:
                context_bound.refuse_early(body, max_context)  # before a token id of it is parsed
            job = parse(_json(body), max_context)
            if not table.is_known(job.model):
                raise OpenAIError(404, f"The model `{job.model}` does not exist.", param="model",
                                  code="model_not_found")
            events = _events(relay, job)
            first = await unless_gone(request, anext(events))  # a refusal or an early failure raises here (inv. 1)
        except OpenAIError as e:
            return JSONResponse(status_code=e.status, content=e.body())
        except Gone:  # held in the router or queued in an engine: closed at once (invariant 2)
            return Response(status_code=499)
        if job.stream:
            return ClosingStreamingResponse(_sse(job, first, events), media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})
        return await until_disconnect(request, _whole(job, first, events))

    return api


def _json_content(content_type: str | None) -> None:
    """A body declared as anything but JSON is refused (415); none declared is read as JSON (as FastAPI's routes
    do, /v1/generate's). A `text/plain` or form body is what a web page may send without a CORS preflight: it was
    served (an anonymous router on the node spending its engines for any page open in a browser there)."""
    if content_type is None:
        return
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise OpenAIError(415, f"Unsupported Content-Type {kind!r}: send the body as application/json",
                          code="unsupported_media_type")


def _json(body: bytes) -> Any:
    """JSON in UTF-8 only (RFC 8259 8.1): `json.loads` of bytes also took UTF-16 and UTF-32, which the early
    context bound (context_bound.py, UTF-8) cannot read, so their prompts were parsed whole before the refusal."""
    try:
        return json.loads(body.decode("utf-8"))
    except ValueError as e:  # broken JSON, not UTF-8, or an integer past Python's 4300 digits (it was a 500)
        raise OpenAIError(400, f"We could not parse the JSON body of your request: {e}") from None
    except RecursionError:
        raise OpenAIError(400, "We could not parse the JSON body of your request: nested too deeply") from None





async def _events(relay: Relay, job: Job) -> AsyncIterator[str | End]:
    """Non-empty text pieces, then one End. Raises OpenAIError before the first piece."""
    items = relay.run(job.generate, job.request_id)
    scan = StopScanner(job.stops)
    count = 0
    try:
        async for item in items:
            if item.get("done"):
                if "error" in item:  # in-band: tokens were already generated
                    err = item["error"]
                    yield End("error", count, OpenAIError(502, err.get("message", ""), code=err.get("code")))
                    return
                rest = scan.push(item.get("text", ""))  # the engine's text of an unfinished last character
                stopped = scan.stopped
                if tail := rest + ("" if stopped else scan.flush()):
                    yield tail
                yield End("stop" if stopped else FINISH_REASONS.get(item.get("finish_reason", ""), "stop"), count)
                return
            count += 1
            if text := scan.push(item.get("text", "")):
                yield text
            if scan.stopped:
                relay.enough(job.request_id)
                await items.aclose()  # closes the engine request now, before the client hears of the stop
                yield End("stop", count)
                return
        yield End("error", count, OpenAIError(502, "the relay ended without a final line", code="truncated"))
    except RelayError as e:  # only before any token: the relay reports later errors in-band
        raise refusal(e.status, e.code, e.message, job.kind) from None
    finally:
        await items.aclose()


async def _sse(job: Job, first: str | End, events: AsyncIterator[str | End]) -> AsyncIterator[bytes]:
    created = int(time.time())
    if job.kind == "chat":
        yield fmt.sse(fmt.chunk(job, created, None, first=True))
    ev = first
    while not isinstance(ev, End):
        yield fmt.sse(fmt.chunk(job, created, ev))
        ev = await anext(events)
    if ev.error is not None:
        yield fmt.sse(ev.error.body())
        return
    yield fmt.sse(fmt.chunk(job, created, None, ev.finish_reason))
    if job.include_usage:
        yield fmt.sse(fmt.usage_chunk(job, created, ev.completion_tokens))
    yield fmt.DONE


async def _whole(job: Job, first: str | End, events: AsyncIterator[str | End]) -> Response | dict[str, Any]:
    parts: list[str] = []
    ev = first
    while not isinstance(ev, End):
        parts.append(ev)
        ev = await anext(events)
    if ev.error is not None:
        return JSONResponse(status_code=ev.error.status, content=ev.error.body())
    return fmt.body(job, int(time.time()), "".join(parts), ev.finish_reason, ev.completion_tokens)
