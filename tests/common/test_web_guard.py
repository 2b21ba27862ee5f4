"""The front door every Holdfast HTTP API shares (libs/common/web): the guard, the lingering protocols (h11 and
httptools) and `Intake`. The admin API's real app (its guard, its audit record) on a real uvicorn server and socket
for what crosses the network; `Intake` as pure logic on an event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from libs.common import procs
from libs.common.web.intake import Intake
from libs.common.web.linger import MAX_HEAD_BYTES, LingerStats, lingering_h11, lingering_httptools
from services.controller.api.app import create_app
from services.controller.api.context import ApiContext
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView
from tests.router.test_api_keys import trickle_until_answered

ADMIN = "adm"


def started(app: Any, http: Any, **config: Any) -> tuple[uvicorn.Server, threading.Thread, int]:
    """`app` served by uvicorn with the protocol `http` (and `config`) on a free port, on a thread of its own, once
    it serves: the server, its thread, the port."""
    port = procs.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=http,
                                           lifespan="off", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return server, thread, port


@contextlib.contextmanager
def serving(app: Any, http: Any) -> Iterator[int]:
    """`started`, stopped on leaving; the port."""
    server, thread, port = started(app, http)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def bare_context() -> ApiContext:
    """The admin API's context with no store or bus behind it (the calls here end before a route needs one)."""
    return ApiContext(settings=ControllerSettings(), view=ClusterView(), store=None, bus=None,  # type: ignore[arg-type]
                      metrics=None, is_leader=lambda: False, admin_token=ADMIN)


@pytest.fixture
def admin_api() -> Iterator[tuple[int, ApiContext]]:
    """The admin API's app as the controller serves it (server.py: its guard inside, the lingering h11 protocol
    with a 1 s body bound); no store or bus behind it (the calls here end before a route runs)."""
    ctx = bare_context()
    with serving(create_app(ctx), lingering_h11(1 << 20, 1.0, LingerStats(), 10.0, 1.0)) as port:
        yield port, ctx


def test_a_write_whose_body_comes_too_slowly_is_answered_408_and_audited_once(
        admin_api: tuple[int, ApiContext]) -> None:
    """The guard's 413 and 400 of a write were audited; the protocol's 408 was recorded as a 400: the app saw a
    disconnect only, which FastAPI's body parse makes a 400 that nobody reads (the client has its 408)."""
    port, ctx = admin_api
    head = (f"POST /v1/engines/e-1/failover HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
            "Content-Type: application/json\r\n")
    sent, got = trickle_until_answered(port, head, 100, 0.1)  # 10 s to complete, ten times the bound
    assert sent < 100 and got.startswith(b"HTTP/1.1 408"), got[:200]
    assert json.loads(got.partition(b"\r\n\r\n")[2])["error"] == "request_timeout"
    deadline = time.monotonic() + 5
    while not ctx.audit.newest(10):
        assert time.monotonic() < deadline, "no audit entry"
        time.sleep(0.05)
    time.sleep(0.3)  # the app's own end of the request (its 400, dropped) comes after: it must not be recorded
    assert [(e.what, e.outcome) for e in ctx.audit.newest(10)] == [("POST /v1/engines/e-1/failover", "408")]
    assert ctx.audit.newest(1)[0].who.startswith("admin token")


def test_head_on_the_admin_apis_get_routes_answers_as_get_without_a_body(admin_api: tuple[int, ApiContext]) -> None:
    port, _ = admin_api
    headers = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.head(f"http://127.0.0.1:{port}/v1/audit", headers=headers, timeout=10)
    assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) > 0, r.status_code
    assert httpx.head(f"http://127.0.0.1:{port}/v1/audit", timeout=10).status_code == 401  # the same guard as GET



def test_a_request_with_two_authorization_headers_is_refused_whichever_comes_first(
        admin_api: tuple[int, ApiContext]) -> None:
    """The guard read the last header, the route's `HTTPBearer` the first: one token let the request in, another
    scoped and audited it."""
    port, _ = admin_api
    for first, last in ((ADMIN, "unknown"), ("unknown", ADMIN), (ADMIN, ADMIN)):
        r = httpx.get(f"http://127.0.0.1:{port}/v1/audit", timeout=10,
                      headers=[("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {last}")])
        assert r.status_code == 400 and r.json()["error"] == "bad_request", (first, last, r.text)
    assert httpx.get(f"http://127.0.0.1:{port}/v1/audit", headers={"Authorization": f"Bearer {ADMIN}"},
                     timeout=10).status_code == 200

@pytest.mark.parametrize("protocol", [lingering_h11, lingering_httptools])
def test_bytes_that_are_not_http_get_the_apis_json_error_not_uvicorns_text(protocol: Any) -> None:
    ctx = bare_context()
    with serving(create_app(ctx), protocol(1 << 20, 1.0, LingerStats())) as port:
        for junk in (b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(junk)
                got = b""
                while chunk := s.recv(4096):
                    got += chunk
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), got
            assert json.loads(body)["error"] == "bad_request"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/audit", headers={"Authorization": f"Bearer {ADMIN}"},
                         timeout=10).status_code == 200  # serving on


@pytest.mark.parametrize("protocol", [lingering_h11, lingering_httptools])
def test_a_stopping_server_neither_lingers_nor_waits_for_idle_kept_alive_connections(protocol: Any) -> None:
    """At a server's stop every idle connection closes and every lingering one ends at once: the graceful
    shutdown waited for each linger (up to `max_s`, 60 s here), and a kept-alive idle connection began one; the
    controller then outlived a supervisor's 5 s after its SIGTERM and was SIGKILLed (full test runs, 2026-12-06)."""
    ctx = bare_context()
    stats = LingerStats()
    server, thread, port = started(create_app(ctx), protocol(1 << 30, 60.0, stats), timeout_graceful_shutdown=60)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as idle, \
            socket.create_connection(("127.0.0.1", port), timeout=10) as refused:
        idle.sendall(b"GET /v1/audit HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ADMIN.encode() + b"\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")  # answered; the connection kept alive, idle
        refused.sendall(b"POST /v1/engines/e/failover HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100000000\r\n\r\n" + b" " * 4096)
        assert refused.recv(4096).startswith(b"HTTP/1.1 401")  # refused unread: lingering, its client still there
        while stats.lingered < 1:
            time.sleep(0.01)
        t0 = time.monotonic()
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server still waits for its connections"
        assert time.monotonic() - t0 < 30
        assert idle.recv(4096) == b"" and refused.recv(1 << 16) is not None  # closed by the server


@pytest.mark.parametrize("protocol", [lingering_h11, lingering_httptools])
def test_a_client_that_never_reads_its_answers_is_aborted_after_the_send_bound_and_others_are_served(
        protocol: Any) -> None:
    """Connections without a token that pipelined the public `/openapi.json` and never read held their fds and the
    answers' memory past every other bound (the admin API, 300 of them: every other client timed out meanwhile)."""
    ctx = bare_context()
    stats = LingerStats()
    with serving(create_app(ctx), protocol(1 << 20, 1.0, stats, send_timeout_s=1.0)) as port:
        stalled = []
        for _ in range(8):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 200)  # then never read
            stalled.append(s)
        try:
            deadline = time.monotonic() + 30
            while stats.slow_readers < len(stalled):
                assert time.monotonic() < deadline, f"{stats.slow_readers} of {len(stalled)} aborted"
                r = httpx.get(f"http://127.0.0.1:{port}/v1/audit", headers={"Authorization": f"Bearer {ADMIN}"},
                              timeout=10)
                assert r.status_code == 200  # served meanwhile
                time.sleep(0.2)
            for s in stalled:  # each was aborted: what it reads now ends in a reset or EOF, never waits
                s.settimeout(10)
                with contextlib.suppress(ConnectionResetError):
                    while s.recv(1 << 20):
                        pass
        finally:
            for s in stalled:
                s.close()



def test_a_head_past_the_bound_is_431_on_httptools_and_a_large_body_after_a_small_head_is_not() -> None:
    """httptools parsed a head of any size: a 64 MB header held the batched engine's front 5-6 s (its streams
    paused 2.1 s) and 110 MB of its memory. h11 bounds its own (16 KiB)."""
    ctx = bare_context()
    with serving(create_app(ctx), lingering_httptools(1 << 20, 1.0, LingerStats())) as port:
        for head in (b"X-Big: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n",
                     b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEAD_BYTES // 8))):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                    s.sendall(b"GET /v1/audit HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
                got = b""
                with contextlib.suppress(ConnectionResetError):
                    while chunk := s.recv(65536):
                        got += chunk
            assert got.startswith(b"HTTP/1.1 431"), got[:200]
            assert json.loads(got.partition(b"\r\n\r\n")[2])["error"] == "headers_too_large"
        body = json.dumps({"successor": "x" * (600 << 10)}).encode()  # one write: a small head, a large body
        r = httpx.post(f"http://127.0.0.1:{port}/v1/engines/e-1/failover", content=body, timeout=30,
                       headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
        assert r.status_code not in (400, 431), r.text[:200]


# ---- Intake: a burst taken a slice per pass of the loop


def _request(path: str) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "headers": []}


async def test_a_burst_goes_in_a_slice_a_pass_in_arrival_order_and_whats_beside_it_runs_between() -> None:
    """50 requests arriving in one pass, each 1 ms of work that never waits (a refusal): they ran back to back
    before, and a stream beside them (here a coroutine that yields every pass) waited for all of them."""
    order: list[int] = []

    async def app(scope: dict[str, Any], _receive: Any, _send: Any) -> None:
        order.append(int(scope["path"]))
        time.sleep(0.001)  # its parse and its answer: the loop's time, no await

    intake = Intake(app, budget_s=0.002)
    ticks = 0
    done = asyncio.Event()

    async def beside() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    stream = asyncio.create_task(beside())
    await asyncio.sleep(0)
    await asyncio.gather(*(intake(_request(str(i)), None, None) for i in range(50)))
    done.set()
    await stream
    assert order == list(range(50))
    assert intake.deferred > 0 and intake.stats()["waiting"] == 0
    assert ticks >= 10, ticks  # 50 ms of work over at least ~25 passes; all in one pass before


async def test_a_waiter_that_goes_away_costs_the_others_nothing() -> None:
    ran: list[int] = []

    async def app(scope: dict[str, Any], _receive: Any, _send: Any) -> None:
        ran.append(int(scope["path"]))
        time.sleep(0.003)  # past the budget: every later request waits

    intake = Intake(app, budget_s=0.002)
    tasks = [asyncio.create_task(intake(_request(str(i)), None, None)) for i in range(20)]
    await asyncio.sleep(0)  # all in: the first ran, the rest wait
    for t in tasks[5:10]:
        t.cancel()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    assert ran == [i for i in range(20) if not 5 <= i < 10]
    assert sum(isinstance(r, asyncio.CancelledError) for r in results) == 5
    assert intake.stats()["waiting"] == 0


async def test_a_quiet_loop_lets_each_request_in_at_once() -> None:
    async def app(_scope: dict[str, Any], _receive: Any, _send: Any) -> None:
        pass

    intake = Intake(app)
    for i in range(20):
        await intake(_request(str(i)), None, None)
        await asyncio.sleep(0.003)  # one at a time, the loop quiet between
    assert intake.deferred == 0


async def test_a_health_probe_goes_in_ahead_of_a_burst_that_waits() -> None:
    # a liveness probe queued behind a router's burst answered 20 s late (probe of 2026-12-07)
    ran: list[str] = []

    async def app(scope: dict[str, Any], _receive: Any, _send: Any) -> None:
        ran.append(scope["path"])
        time.sleep(0.003)  # past the budget: every later request waits

    intake = Intake(app, budget_s=0.002, exempt=frozenset({"/healthz"}))
    burst = [asyncio.create_task(intake(_request(str(i)), None, None)) for i in range(20)]
    await asyncio.sleep(0)  # the first ran; the rest wait
    await intake(_request("/healthz"), None, None)
    assert ran[:2] == ["0", "/healthz"] and intake.stats()["waiting"] == 19
    await asyncio.wait_for(asyncio.gather(*burst), 10)
    assert ran[2:] == [str(i) for i in range(1, 20)]
