"""A request's work cancelled the moment its client goes away: the router's routes and the batched engine's front
run a whole (not streamed) request's work so, and the wait for a stream's first token (a client that gave up left
its request generating to its end, or waiting in an engine's queue to be prefilled, holding an engine's blocks and a
place in its batch). ASGI, no I/O of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

T = TypeVar("T")


class Gone(Exception):
    """The client went away before the work it waited for was done (the work was cancelled)."""


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result (or its exception); if the client goes away first, `work` is cancelled at once (its cleanup
    closes what it opened) and `Gone` is raised. The body is read already, so the next ASGI message can only be
    the disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise Gone
    return task.result()


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or a 499 nobody reads if the client goes away first (`unless_gone`)."""
    try:
        return await unless_gone(request, work)
    except Gone:
        return Response(status_code=499)


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the response ends. Starlette leaves it suspended when the client goes
    away while a chunk is being sent, and the work under it (an engine request) would stay open until GC."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def disconnected(request: Request) -> None:
    """Returns once the client has gone away (its body already read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
