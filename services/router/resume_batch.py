"""Resumes sent to one engine together: one `POST /generate_many` for every replay that picks it at once.

Why: when an engine dies, every stream it served is replayed on its successor at the same moment (they all wake
when the successor's endpoint is added). Sent one by one, 80 replays were 80 new connections and 80 requests,
taken breadth-first by this router's event loop and the engine's: the first reached the engine's handler
80-142 ms after it was sent (H200, 8b, 64 + 16 streams). One request carries them all; its NDJSON lines are
each tagged with `"i"`, the index of their request (engines/batched/server.py), and handed to that request's
own queue here.

Invariants:
1. A member sees exactly the line sequence a `/generate` stream of its own would give: token lines, then one
   final line; the shared stream ending (or failing) before a member's final line is that member's failure
   (`UpstreamFailed` in the relay, so it replays on another engine as ever).
2. A member that stops early (its client went away, a stop string matched) is aborted at the engine by
   `POST /abort {request_id}`: the shared connection stays open for the others. The last member out closes it.
3. An engine without `/generate_many` (404/405/422: the reference engine) is remembered, and its members, and
   every later resume to it, send their own `/generate`.
4. Only replays (attempts after a failure) are batched: a first attempt never waits for a window.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("holdfast.router.resume")
UNSUPPORTED_STATUS = frozenset({404, 405, 422})


class BatchUnsupported(Exception):
    """The engine has no `/generate_many`: send this one alone."""


@dataclass
class Member:
    body: dict[str, Any]
    lines: asyncio.Queue[str | BaseException | None] = field(default_factory=asyncio.Queue)
    started: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    ended: bool = False  # its final line was handed over, or it left


@dataclass
class _Batch:
    url: str
    members: list[Member] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    open_members: int = 0


class ResumeBatcher:
    """One shared request per engine URL for the replays that pick it within `window_s` of each other."""

    def __init__(self, client: httpx.AsyncClient, *, window_s: float, timeout: httpx.Timeout) -> None:
        self.client, self.window_s, self.timeout = client, window_s, timeout
        self._forming: dict[str, _Batch] = {}
        self._unsupported: set[str] = set()
        self.batches = 0
        self.batched_requests = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    def supports(self, url: str) -> bool:
        return url not in self._unsupported

    @contextlib.asynccontextmanager
    async def stream(self, url: str, body: dict[str, Any]) -> AsyncIterator[tuple[int, AsyncIterator[str]]]:
        """Join the batch forming for `url`; yields the shared response's status and this member's lines.
        Raises BatchUnsupported (send it alone), or httpx errors of the shared request."""
        batch = self._forming.get(url)
        if batch is None:
            batch = self._forming[url] = _Batch(url)
            batch.task = asyncio.create_task(self._run(batch), name=f"resume-batch {url}")
        member = Member(body)
        batch.members.append(member)
        batch.open_members += 1
        try:
            status = await member.started
            yield status, self._lines(member)
        finally:
            batch.open_members -= 1
            if self._forming.get(url) is batch:  # not sent yet: it leaves the batch, nothing to abort
                batch.members.remove(member)
            elif not member.ended:
                member.ended = True
                self._abort_at_engine(url, body.get("request_id"))
            if batch.open_members == 0 and batch.task is not None and self._forming.get(url) is not batch:
                batch.task.cancel()  # invariant 2: the last member out closes the shared connection

    async def _lines(self, member: Member) -> AsyncIterator[str]:
        while True:
            item = await member.lines.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def _run(self, batch: _Batch) -> None:
        await asyncio.sleep(self.window_s)  # the others woken by the same endpoint event join meanwhile
        del self._forming[batch.url]
        members = batch.members  # fixed from here on: a line's "i" indexes it
        if not members:  # every member left while it formed
            return
        self.batches += 1
        self.batched_requests += len(members)
        try:
            async with self.client.stream("POST", batch.url + "/generate_many",
                                          json={"requests": [m.body for m in members]}, timeout=self.timeout) as resp:
                if resp.status_code in UNSUPPORTED_STATUS:
                    if resp.status_code != 422:  # 422: one body is refused; each alone gets its own answer
                        self._unsupported.add(batch.url)
                    _fail_all(members, BatchUnsupported(f"{batch.url} answered {resp.status_code}"))
                    return
                for m in members:
                    _start(m, resp.status_code)
                if resp.status_code != 200:
                    return
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    obj = json.loads(line)
                    m = members[int(obj.pop("i"))]
                    if m.ended:
                        continue
                    m.lines.put_nowait(json.dumps(obj))
                    if obj.get("done"):
                        m.ended = True
                        m.lines.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the shared stream's failure is each open member's (invariant 1)
            _fail_all(members, e)
            return
        finally:
            for m in members:  # the stream ended: a member without its final line sees its stream end short
                if not m.started.done():
                    m.started.set_exception(ConnectionError("the shared resume request ended"))
                if not m.ended:
                    m.lines.put_nowait(None)

    def _abort_at_engine(self, url: str, request_id: str | None) -> None:
        if not request_id:
            return

        async def send() -> None:
            with contextlib.suppress(httpx.HTTPError):
                await self.client.post(url + "/abort", json={"request_id": request_id}, timeout=self.timeout)

        t = asyncio.create_task(send())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def stats(self) -> dict[str, int]:
        return {"batches": self.batches, "batched_requests": self.batched_requests}


def _start(m: Member, status: int) -> None:
    if not m.started.done():
        m.started.set_result(status)


def _fail_all(members: list[Member], e: BaseException) -> None:
    for m in members:
        if not m.started.done():
            m.started.set_exception(e)
        elif not m.ended:
            m.lines.put_nowait(e)
