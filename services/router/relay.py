"""One client request relayed to engines, resumed on another engine when its engine fails.

The relay sends the engine `{request_id, prompt, tokens (as the client sent them), resume: tokens generated so
far, max_tokens: what is left}`; the reference engine's exact-resume invariant (engines/reference/engine.py) makes the continuation
identical to the uninterrupted generation, so the client sees one stream. Invariants:
1. Every client request ends in exactly one of: completed, an explicit error (a 503/502 JSON body before
   the stream starts, or a final `{"done": true, "error": ...}` line after), or the client going away.
2. A token is forwarded once: token lines are renumbered by the relay, never repeated after a resume.
3. A failed engine (connection error, 5xx, a stream cut short, an in-band engine error, silence past
   `token_timeout_s`, or its endpoint removed by an event) is never retried for that request before another
   endpoint is tried; it is marked suspect so new requests avoid it too.
4. One client request has one `request_id` (the caller's, or `gen-<uuid>`), sent in every attempt's body, so a
   successor can recognise a request it resumes.
5. When the relay stops early (the client went away, or the caller closed it after `enough`), the engine
   request is closed at once: its connection is dropped, which makes the engine stop generating and free
   the slot.
6. A request that engines failed while running (`engine_error` in-band) `max_engine_errors` times is not replayed
   again (502 `engine_error_repeated`): a request that ends the engine's step loop would otherwise end every
   engine of its model in turn. Deaths from outside (a SIGKILL: a cut connection) do not count.
7. An engine that refuses a request for now (`queue_full`: its queue is at its bound) is sound, never suspect: a
   new request is answered 503 `queue_full` at once (the client retries, as OpenAI's clients do), a resumed one
   waits for room on it up to `hold_timeout_s`. Taken for a failure, a burst had the router avoid an idle engine
   for `suspect_s` and answer `no_endpoint` (probe of 2026-12-06). So is one the router cannot reach for want of its
   own descriptors or memory (a connect failing with EMFILE: `RouterStarved`), answered 503
   `router_out_of_resources` (a router out of fds had a healthy engine suspect and answered 502, probe of
   2026-12-07). So is one whose connect timed out on the router's clock while it accepts connections, asked
   again off the loop (`RouterLate`, reach.py): the router's loop was late, not the engine; the request, new or
   resumed, tries again up to `hold_timeout_s`, then 503 `router_overloaded`. An engine made suspect is logged,
   once a spell.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from pydantic import Field

from libs.common.generate import GenerateRequest, Sampling, Seed
from services.router.reach import Reach
from services.router.resume_batch import BatchUnsupported, ResumeBatcher
from services.router.route_ins import RouteIns
from services.router.settings import RouterSettings
from services.router.table import Endpoint, EndpointTable, HoldRejected

T = TypeVar("T")
log = logging.getLogger("holdfast.router")
MODEL_MAX = 256  # a model name's characters at most


class ClientRequest(Sampling):
    """What a client asks the router to generate (`POST /v1/generate`; the OpenAI routes build one too). Each
    attempt sends an engine the shared `GenerateRequest` (libs/common/generate.py) built from it."""

    model: str = Field(min_length=1, max_length=MODEL_MAX)
    seed: Seed | None = Field(None, description="none with temperature > 0: the router picks one, so a replay "
                             "continues the same sampled text")


class RelayError(Exception):
    """An explicit error for the client: HTTP status + code + message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message}}


class UpstreamFailed(Exception):
    pass


class EngineBusy(Exception):
    """The engine refused the request for now (`queue_full`): a sound engine at its bound (invariant 7). A new
    request is answered `code` at once unless `retry_new`; a resumed one waits for room up to `hold_timeout_s`."""

    code = "queue_full"
    retry_new = False


class RouterStarved(EngineBusy):
    """The router itself could not reach the engine for want of a descriptor or kernel memory (its connect failed
    with EMFILE, ENFILE, ENOBUFS, ENOMEM): the engine ran nothing of it and is not to blame (it was marked suspect,
    and a healthy engine shunned, while the router was out of fds). Held and retried as a busy engine's refusal."""

    code = "router_out_of_resources"


class RouterLate(EngineBusy):
    """The connect timed out on the router's clock while the engine accepts connections (reach.py): the router's
    own loop was too late to see it finish. The engine is not to blame; the request, new or resumed, tries again
    after a pause, up to `hold_timeout_s`, then 503 `router_overloaded`."""

    code = "router_overloaded"
    retry_new = True


STARVED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
REACH_CHECK_S = 0.5  # the off-loop connect's bound (reach.py)


def _starved(e: BaseException) -> str | None:
    """The router's own exhaustion behind `e` (httpx wraps the OSError in its own errors), or None."""
    seen: BaseException | None = e
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in STARVED:
            return f"the router has no {'memory' if seen.errno in (errno.ENOBUFS, errno.ENOMEM) else 'descriptor'} " \
                   f"left to reach an engine ({errno.errorcode[seen.errno]}); try again soon"
        seen = seen.__cause__ or seen.__context__
    return None


def _busy(status: int, body: bytes) -> None:
    """Raise `EngineBusy` when an engine's non-200 answer is its `queue_full` refusal (503 or 429)."""
    if status not in (429, 503):
        return
    try:
        _raise_if_busy(json.loads(body).get("error"))
    except (ValueError, AttributeError):
        return


def _raise_if_busy(err: Any) -> None:
    """Raise `EngineBusy` when an engine's error (an answer's body, or a stream's in-band end) is `queue_full`."""
    if isinstance(err, dict) and err.get("code") == "queue_full":
        raise EngineBusy(str(err.get("message", "its queue is full")))


class EngineErrored(UpstreamFailed):
    """The engine ended the stream with its own `engine_error`: its step loop (or generation) failed while
    running this request. Not told apart from a fault of the engine's own, so replayed, but only so often
    (`max_engine_errors`, invariant 6)."""


@dataclass
class Stats:
    requests: int = 0
    completed: int = 0
    failed: int = 0  # explicit errors from the router (held too long, queue full, replays exhausted)
    rejected: int = 0  # of `failed`: refused before streaming (503)
    client_errors: int = 0  # the engine refused the request itself (4xx), passed through
    cancelled: int = 0  # the client went away
    replayed: int = 0  # resumptions on another engine
    in_flight: int = 0
    lines: int = 0  # token lines relayed (with /stats `cpu_s`: the router's CPU a line)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Cut:
    """One attempt's stream, cut when its endpoint is removed (`fire`): the read it is waiting in ends at once.

    The read waits under an `asyncio.timeout` (the silence bound) that `fire` moves to now, so a line costs one
    timer, not the two tasks and the `asyncio.wait` of racing the read against an event: at 64 streams the
    router spent ~100 us a line there (its loop then held 20-36 ms at a time after a kill, H200)."""

    def __init__(self) -> None:
        self._fired = False
        self._cm: asyncio.Timeout | None = None

    def is_set(self) -> bool:
        return self._fired

    def fire(self) -> None:
        self._fired = True
        if self._cm is not None:
            self._cm.reschedule(asyncio.get_running_loop().time())

    async def answer(self, opening: Coroutine[Any, Any, T]) -> T:
        """The engine's answer (its response headers), unless the endpoint is removed meanwhile: an engine of a lost
        or frozen node accepted the connection and never answered, and its request waited out the client's whole
        read timeout (`token_timeout_s`, 30 s) after its endpoint was removed and a successor served (probe of
        2026-12-07); the other bounds are the client's own. A replay's wait for its batched resume is one too."""
        if self._fired:
            opening.close()
            raise UpstreamFailed("endpoint removed")
        return await self._until_cut(opening, None)

    async def next_line(self, lines: AsyncIterator[str], silence_s: float) -> str:
        """The next line of the upstream stream, unless the endpoint is removed or stays silent too long."""
        if self._fired:
            raise UpstreamFailed("endpoint removed")
        return await self._until_cut(lines.__anext__(), silence_s)  # StopAsyncIteration when the stream ends

    async def _until_cut(self, waiting: Awaitable[T], limit_s: float | None) -> T:
        """`waiting` under the one timer `fire` moves to now, bounded by `limit_s` (None: by `fire` alone)."""
        try:
            async with asyncio.timeout(limit_s) as cm:
                self._cm = cm
                try:
                    return await waiting
                finally:
                    self._cm = None
        except TimeoutError:
            raise UpstreamFailed("endpoint removed" if self._fired or limit_s is None
                                 else f"no token for {limit_s:g}s") from None


@dataclass
class InFlight:
    """Streams open per engine, so an `endpoint.removed` event can cut them and have them resumed."""

    aborts: dict[str, set[Cut]] = field(default_factory=dict)

    def add(self, engine_id: str) -> Cut:
        cut = Cut()
        self.aborts.setdefault(engine_id, set()).add(cut)
        return cut

    def discard(self, engine_id: str, cut: Cut) -> None:
        cuts = self.aborts.get(engine_id)
        if cuts is not None:
            cuts.discard(cut)
            if not cuts:
                del self.aborts[engine_id]

    def abort(self, engine_id: str) -> int:
        cuts = self.aborts.get(engine_id, set())
        for cut in list(cuts):
            cut.fire()
        return len(cuts)


ROUTER_MARKS = ("sent", "connect", "connected", "answered", "first_line")
CONNECT_EVENTS = {"connection.connect_tcp.started": "connect", "connection.connect_tcp.complete": "connected"}


def router_ms(marks: dict[str, float]) -> dict[str, float]:
    """The last attempt's way to its first token in this router, ms after the request came in: sent to the
    engine (the table's pick, a wait for an endpoint), a new connection's connect begun and done (none where an
    idle one was taken: spare.py), its response's head, its first token line read."""
    return {name: round((marks[name] - marks["in"]) * 1000, 2) for name in ROUTER_MARKS if name in marks}


class Relay:
    def __init__(self, table: EndpointTable, client: httpx.AsyncClient, settings: RouterSettings) -> None:
        self.table = table
        self.client = client
        self.settings = settings
        self.stats = Stats()
        self.inflight = InFlight()
        self.route_ins = RouteIns()
        # replays to one engine within a window go as one request (resume_batch.py); 0: each alone
        self.resumes = ResumeBatcher(client, window_s=settings.resume_batch_s,
                                     timeout=httpx.Timeout(settings.token_timeout_s, connect=settings.connect_timeout_s))
        self._enough: set[str] = set()  # request ids whose caller has all it wants (see `enough`)
        # a timed-out connect asked again off the loop (reach.py), briefly: an engine that accepts does so in
        # milliseconds, and a dead one is not to wait twice the connect timeout before it is suspect
        self.reach = Reach(min(settings.connect_timeout_s, REACH_CHECK_S))

    def enough(self, request_id: str) -> None:
        """The caller has all it wants of this request (a stop string matched) and closes its `run` next:
        the request then counts as completed, not cancelled. A mark rather than an exception thrown in, so
        that it works through wrappers of `run` (metrics.py), which pass on only `aclose`."""
        self._enough.add(request_id)

    def endpoint_gone(self, engine_id: str) -> int:
        """An event removed this engine: cut its streams (they resume elsewhere)."""
        return self.inflight.abort(engine_id)

    async def run(self, req: ClientRequest, request_id: str | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """Token lines, then one final line. Raises RelayError before the first line; after it, an error
        is a final `{"done": true, "error": ...}` line. Closed or cancelled (its client gone, an early stop), it
        closes the engine request at once and counts as cancelled (or completed after `enough`)."""
        s = self.settings
        rid = request_id or f"gen-{uuid.uuid4().hex}"  # the same in every attempt (invariant 4)
        received_at = time.time()
        marks: dict[str, float] = {"in": time.perf_counter()}  # where the first token's time went in this router
        self.stats.requests += 1
        self.stats.in_flight += 1
        seed = req.seed if req.seed is not None else (random.getrandbits(31) if req.temperature > 0 and not req.greedy else 0)
        generated: list[int] = []
        engines: list[str] = []
        attempts = errored = 0
        busy_until: float | None = None  # a resumed request waits for room on a busy engine until then
        busy = 0
        outcome = "cancelled"
        try:
            while True:
                try:
                    ep = await self.table.acquire(req.model, s.hold_timeout_s, admitted=attempts > 0)
                except HoldRejected as e:
                    raise RelayError(503, e.code, e.message) from None
                engines.append(ep.engine_id)
                offset = len(generated)
                wait_s = 0.0
                try:
                    # aclosing: an early stop (enough, the client gone) closes the engine stream now, not at GC
                    attempt_lines = self._attempt(ep, req, seed, generated, rid, marks, replay=attempts > 0)
                    async with contextlib.aclosing(attempt_lines) as attempt:
                        async for item in attempt:
                            if item.get("done"):
                                prompt_tokens = item.get("prompt_tokens")
                                item = {**item, "model": req.model, "completion_tokens": len(generated),
                                        "prompt_tokens": None if prompt_tokens is None else prompt_tokens - offset,
                                        "replays": attempts, "engines": engines, "request_id": rid,
                                        "router_received_at": received_at, "router_ms": router_ms(marks)}
                                outcome = "completed"
                            yield item
                    if outcome == "completed":
                        return
                    raise UpstreamFailed("stream ended without a final line")
                except EngineBusy as e:  # invariant 7 (the router's own exhaustion or lateness alike: none to blame)
                    engines.pop()  # it ran nothing of it
                    now = time.monotonic()
                    busy_until = busy_until or now + s.hold_timeout_s
                    if (not generated and not e.retry_new) or now >= busy_until:
                        message = f"engine {ep.engine_id}: {e}" if e.code == EngineBusy.code else str(e)
                        raise RelayError(503, e.code, message) from None
                    busy += 1
                    wait_s = min(0.05 * 2 ** min(busy, 5), 1.0, busy_until - now)
                except UpstreamFailed as e:
                    if ep.suspect_until <= self.table.clock():  # said once a spell
                        log.warning("engine %s (%s) of %s failed a request: suspect for %g s (%s)", ep.engine_id,
                                    ep.url, req.model, s.suspect_s, e)
                    self.table.suspect(ep, s.suspect_s)
                    attempts += 1
                    errored += isinstance(e, EngineErrored)
                    if errored >= s.max_engine_errors:  # invariant 6
                        raise RelayError(502, "engine_error_repeated", f"{errored} engines failed while running this "
                                         f"request ({', '.join(engines)}): not replayed again; last: {e}") from None
                    if attempts > s.max_replays:
                        raise RelayError(502, "replays_exhausted", f"engines failed {attempts} times; last: {e}") from None
                    self.stats.replayed += 1
                finally:
                    self.table.release(ep)
                if wait_s > 0:  # a busy engine, for a resumed request: room again soon, or its bound
                    await asyncio.sleep(wait_s)
        except RelayError as e:
            outcome = "client_error" if 400 <= e.status < 500 else "failed"
            if generated:  # the client already has tokens: the error goes in-band, as the final line
                yield {"done": True, **e.body(), "model": req.model, "completion_tokens": len(generated)}
                return
            raise
        finally:
            self.stats.in_flight -= 1
            if rid in self._enough:
                self._enough.discard(rid)
                outcome = "completed" if outcome == "cancelled" else outcome
            if outcome == "completed":
                self.stats.completed += 1
            elif outcome == "failed":
                self.stats.failed += 1
                if not generated:
                    self.stats.rejected += 1
            elif outcome == "client_error":
                self.stats.client_errors += 1
            else:
                self.stats.cancelled += 1

    async def _attempt(self, ep: Endpoint, req: ClientRequest, seed: int, generated: list[int],
                       request_id: str, marks: dict[str, float], *, replay: bool = False) -> AsyncGenerator[dict[str, Any], None]:
        s = self.settings
        body = GenerateRequest(request_id=request_id, prompt=req.prompt, tokens=req.tokens, resume=generated,
                               max_tokens=req.max_tokens - len(generated), temperature=req.temperature,
                               greedy=req.greedy, seed=seed, stream=True, ignore_eos=req.ignore_eos,
                               strict_length=req.strict_length)
        payload = body.model_dump(exclude_none=True)
        cut = self.inflight.add(ep.engine_id)
        timeout = httpx.Timeout(s.token_timeout_s, connect=s.connect_timeout_s)
        self.route_ins.sent(ep.engine_id)
        marks["sent"] = time.perf_counter()
        for name in ROUTER_MARKS[1:]:
            marks.pop(name, None)
        try:
            if replay and s.resume_batch_s > 0 and self.resumes.supports(ep.url):
                try:
                    async with contextlib.AsyncExitStack() as joined:
                        status, lines = await cut.answer(joined.enter_async_context(
                            self.resumes.stream(ep.url, payload)))
                        self.route_ins.answered(ep.engine_id)
                        marks["answered"] = time.perf_counter()
                        if status != 200:
                            raise UpstreamFailed(f"engine answered {status} to a batched resume")
                        async for item in self._lines(lines, cut, generated, marks):
                            yield item
                    return
                except BatchUnsupported:
                    pass  # this engine takes requests one by one (resume_batch.py invariant 3)
            async def trace(name: str, info: dict[str, Any]) -> None:  # httpcore's events: a new connection's
                if name in CONNECT_EVENTS:
                    marks[CONNECT_EVENTS[name]] = time.perf_counter()

            async with contextlib.AsyncExitStack() as opened:
                resp = await cut.answer(opened.enter_async_context(self.client.stream(
                    "POST", ep.url + "/generate", json=payload, timeout=timeout, extensions={"trace": trace})))
                self.route_ins.answered(ep.engine_id)
                marks["answered"] = time.perf_counter()
                if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                    raise RelayError(resp.status_code, "engine_refused", (await resp.aread()).decode(errors="replace")[:2000])
                if resp.status_code != 200:
                    _busy(resp.status_code, await resp.aread())
                    raise UpstreamFailed(f"engine answered {resp.status_code}")
                async for item in self._lines(resp.aiter_lines(), cut, generated, marks):
                    yield item
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError, ConnectionError) as e:
            if (why := _starved(e)) is not None:
                raise RouterStarved(why) from None
            if isinstance(e, httpx.ConnectTimeout) and await self.reach.accepts(ep.url):
                raise RouterLate(f"the router was too busy to connect to engine {ep.engine_id} in "
                                 f"{s.connect_timeout_s:g}s, although it accepts connections; try again soon") from None
            raise UpstreamFailed(f"{type(e).__name__}: {e}") from None
        finally:
            self.inflight.discard(ep.engine_id, cut)

    async def _lines(self, lines: AsyncIterator[str], cut: Cut, generated: list[int],
                     marks: dict[str, float]) -> AsyncGenerator[dict[str, Any], None]:
        """One engine stream's lines as the relay's items: tokens appended to `generated`, then the final line."""
        while True:
            try:
                line = await cut.next_line(lines, self.settings.token_timeout_s)
            except StopAsyncIteration:
                return
            if not line.strip():
                continue
            obj = json.loads(line)
            if obj.get("done"):
                if "error" in obj:
                    status = obj.get("status")
                    _raise_if_busy(obj["error"])
                    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
                        raise RelayError(status, "engine_refused", json.dumps(obj["error"])[:2000])
                    if isinstance(obj["error"], dict) and obj["error"].get("code") == "engine_error":
                        raise EngineErrored(f"engine error: {obj['error']}")
                    raise UpstreamFailed(f"engine error: {obj['error']}")
                yield obj
                return
            generated.append(int(obj["token"]))
            self.stats.lines += 1
            marks.setdefault("first_line", time.perf_counter())
            yield {"index": len(generated) - 1, "token": obj["token"], "text": obj.get("text", "")}
