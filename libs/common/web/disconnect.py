"""A whole (not streamed) HTTP request's work cancelled the moment its client goes away: the router's OpenAI routes
and the batched engine's front run theirs so (a client that gave up on a whole request left it generating to its
end, holding an engine's blocks and a place in its batch). ASGI, no I/O of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result; if the client goes away first, `work` is cancelled at once (its cleanup closes what it
    opened) and a 499 nobody reads is the answer. The body is read already, so the next ASGI message can only be
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
        return Response(status_code=499)
    return task.result()


async def disconnected(request: Request) -> None:
    """Returns once the client has gone away (its body already read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
