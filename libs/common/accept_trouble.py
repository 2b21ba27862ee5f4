"""The event loop's own accept loops (asyncio's `create_server`: uvicorn's HTTP servers, the metrics server) when
`accept()` fails for want of a descriptor (EMFILE, ENFILE) or of kernel memory (ENOBUFS, ENOMEM).

asyncio reports each failed accept to the loop's exception handler, whose default logs it with its traceback at
ERROR, and its accept loop tries once for each of its `backlog` slots (2048 in uvicorn) before it pauses a second:
a router out of descriptors wrote 12-49 thousand log lines a second (1 GB in nine minutes, the host's two cores
spent on it) while its health said ok (probe of 2026-12-07). `AcceptTrouble` takes those reports: one warning
when an episode starts, one when the next comes after a quiet spell, a count, and `trouble` for the service's
health meanwhile. Everything else goes to the handler that was there before (the default one). Pure bookkeeping on
the loop's thread; asyncio's own retry (a second's pause, connections waiting in the listen backlog) is unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from libs.common.wire import ACCEPT_QUIET_S, errno_text

log = logging.getLogger("holdfast.accept")

# asyncio's message for it (selector_events._accept_connection); uvloop's reads the same
OUT_OF_RESOURCES = "socket.accept() out of system resource"


class AcceptTrouble:
    def __init__(self, service: str) -> None:
        self.service = service
        self.failures = 0  # in the episode under way
        self.total = 0
        self._since: float | None = None
        self._last = 0.0
        self._error = ""
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
        self.note(exc)

    def note(self, exc: OSError) -> None:
        now = time.monotonic()
        if self._since is None or now - self._last >= ACCEPT_QUIET_S:
            if self._since is not None:
                log.warning("%s: the last episode of failed accepts ended: %d over %.1f s", self.service,
                            self.failures, self._last - self._since)
            self._since, self.failures = now, 0
            log.warning("%s: cannot accept connections (%s); asyncio retries every second, new clients wait in "
                        "the listen backlog (one line per episode)", self.service, errno_text(exc))
        self.failures += 1
        self.total += 1
        self._last, self._error = now, errno_text(exc)

    @property
    def trouble(self) -> str | None:
        """Why accepting fails now, or None once no accept has failed for `ACCEPT_QUIET_S`."""
        if self._since is None or time.monotonic() - self._last >= ACCEPT_QUIET_S:
            return None
        return f"{self._error}: {self.failures} failed accepts in {time.monotonic() - self._since:.1f} s"
