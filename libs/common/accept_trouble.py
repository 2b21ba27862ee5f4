"""The event loop's own accept loops (asyncio's `create_server`: uvicorn's HTTP servers, the metrics server) when
`accept()` fails for want of a descriptor (EMFILE, ENFILE) or of kernel memory (ENOBUFS, ENOMEM).

asyncio reports each failed accept to the loop's exception handler, whose default logs it with its traceback at
ERROR, and its accept loop tries once for each of its `backlog` slots (2048 in uvicorn) before it pauses a second:
a router out of descriptors wrote 12-49 thousand log lines a second (1 GB in nine minutes, the host's two cores
spent on it) while its health said ok (probe of 2026-12-07). `AcceptTrouble` takes those reports into the
episodes the gpu_manager's own accept loop keeps (wire.py `AcceptEpisodes`): one warning when an episode starts, a
count, and `trouble` for the service's health meanwhile. Everything else goes to the handler that was there before
(the default one). Pure bookkeeping on the loop's thread; asyncio's own retry (a second's pause, connections waiting
in the listen backlog) is unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

from libs.common.wire import AcceptEpisodes

# asyncio's message for it (selector_events._accept_connection); uvloop's reads the same
OUT_OF_RESOURCES = "socket.accept() out of system resource"


class AcceptTrouble:
    def __init__(self, service: str) -> None:
        # asyncio's loop reports no accept that went through: an episode ends quietly (`AcceptEpisodes`)
        self.episodes = AcceptEpisodes(service, "asyncio retries every second, new clients wait in the listen "
                                                "backlog (one line per episode)")
        self._previous: Any = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._previous = loop.get_exception_handler()
        loop.set_exception_handler(self._handle)

    def _handle(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") != OUT_OF_RESOURCES or not isinstance(exc, OSError):
            if self._previous is not None:
                self._previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.episodes.failed(exc)

    @property
    def trouble(self) -> str | None:
        return self.episodes.trouble

    @property
    def total(self) -> int:
        return self.episodes.total
