"""The load bench's client: its streams spread over worker processes, each with its own event loop and a light
reader (a raw socket, `recvmsg`, bench/ndjson_http.py) that stamps every token with the kernel's receive time.

Why: one Python loop reading every stream through httpx fell behind the router's output (64 + 16 streams at
~6,000 lines/s), so tokens were stamped when the loop got to them, hundreds of ms after they came (docs/benchmarks.md,
"client"). Invariants:
- a token's arrival is the kernel's receive timestamp (SO_TIMESTAMPNS, CLOCK_REALTIME: the `time.time()` clock of
  every process on the host, the same as the kill's and the engines' wall times) of the read that completed its
  line, so a late loop cannot make a token late. Lines that came in separate segments but are read together
  share the latest segment's stamp (Linux stamps a TCP read with its last segment's time): a stamp is at or after
  its token's arrival, never before, and exact whenever the loop reads faster than a stream's tokens come; `parsed` keeps when the worker parsed it, and the difference is
  reported, with each worker's loop lag (a 5 ms ticker's lateness) and CPU share: a reader can see whether the
  client kept up (a client that stops reading would make the router's writes wait: the lag shows it);
- a worker owns its streams from the request to the end; the parent only sends jobs and collects results.

One client for every serving bench: `bench recovery --streams` sends through the router (`/v1/generate`, naming
the model), `bench serve` straight to one engine (`path="/generate"`, `model=None`: the engine's request model
forbids fields it does not know).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from bench.ndjson_http import NdjsonResponse, request_bytes

# Linux's SO_TIMESTAMPNS (SCM_TIMESTAMPNS is the same value); Python's socket module does not name it
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
TIMESPEC = struct.Struct("@qq")
TICK_S = 0.005
ROUTER_PATH = "/v1/generate"


def default_client_procs() -> int:
    """Client processes: a quarter of the cores (the engines, the router and the bus need the rest), 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


@dataclass(frozen=True)
class Target:
    """Where a worker's streams go: `url` + `path`, naming `model` in each body unless it is None."""

    url: str
    model: str | None
    path: str = ROUTER_PATH
    timeout_s: float = 300.0  # a whole stream's, from its request to its last line
    api_key: str = ""  # the router's (an engine asks for none)


@dataclass
class Job:
    key: int
    prompt: str
    max_tokens: int


@dataclass
class Result:
    key: int
    sent_at: float = 0.0
    response: NdjsonResponse = field(default_factory=NdjsonResponse)


def _kernel_time(ancdata: list[tuple[int, int, bytes]]) -> float | None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= TIMESPEC.size:
            sec, nsec = TIMESPEC.unpack_from(data)
            return sec + nsec / 1e9
    return None


async def read_generation(host: str, port: int, body: dict, out: Result, timeout: float,
                          path: str = ROUTER_PATH, api_key: str = "") -> None:
    """One generate stream (POST `path`) into `out`, within `timeout` seconds in all; never raises: a failure is
    `out.response.error` (a lost request)."""
    loop = asyncio.get_running_loop()
    resp = out.response
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        while not ended.done():
            try:
                data, anc, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(TIMESPEC.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                resp.error = resp.error or f"{type(e).__name__}: {e}"
                ended.set_result(None)
                return
            now = time.time()
            try:
                resp.feed(data, _kernel_time(anc) or now, now)
            except ValueError as e:  # a bad line or response: a finding, as the httpx reader's was
                resp.error, resp.done = f"{type(e).__name__}: {e}", False
                ended.set_result(None)
                return
            if resp.finished:
                ended.set_result(None)

    out.sent_at = time.time()
    try:
        await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
        await loop.sock_sendall(sock, request_bytes(host, port, path, body, api_key))
        loop.add_reader(sock.fileno(), readable)
        try:
            await asyncio.wait_for(ended, timeout)
        finally:
            loop.remove_reader(sock.fileno())
    except Exception as e:  # noqa: BLE001 - a lost request is a finding, reported by the caller
        resp.error = resp.error or f"{type(e).__name__}: {e}"
    finally:
        sock.close()


class Worker:
    """One client process's state: its streams, its loop's lateness, its CPU time."""

    def __init__(self, target: Target) -> None:
        parts = urlsplit(target.url)
        self.host, self.port, self.target = parts.hostname or "127.0.0.1", parts.port or 80, target
        self.results: list[Result] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.lags: list[tuple[float, float]] = []  # (wall time, ms late) per tick

    def start(self, jobs: list[Job]) -> list[Result]:
        new = [Result(j.key) for j in jobs]
        for j, r in zip(jobs, new, strict=True):
            body: dict[str, Any] = {"prompt": j.prompt, "max_tokens": j.max_tokens, "stream": True,
                                    "temperature": 0.0, "ignore_eos": True}
            if self.target.model is not None:
                body["model"] = self.target.model
            self.tasks.append(asyncio.create_task(read_generation(self.host, self.port, body, r,
                                                                  self.target.timeout_s, self.target.path,
                                                                  self.target.api_key)))
        self.results += new
        return new

    async def tick(self) -> None:
        nxt = time.monotonic() + TICK_S
        while True:
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            now = time.monotonic()
            self.lags.append((time.time(), (now - nxt) * 1000))
            nxt = now + TICK_S


async def _recv(conn: multiprocessing.connection.Connection) -> Any:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())
    return conn.recv()


async def _serve(conn: multiprocessing.connection.Connection, target: Target) -> None:
    """A worker's rounds: ("streams", jobs, warm) -> ("warm", error) once each has `warm` tokens; ("late", jobs);
    then ("results", ...) when every stream has ended; ("stop",) ends the process."""
    while True:
        msg = await _recv(conn)
        if msg[0] == "stop":
            return
        w = Worker(target)
        ticker = asyncio.create_task(w.tick())
        cpu0, wall0 = time.process_time(), time.monotonic()
        streams = w.start(msg[1])
        deadline = time.monotonic() + 120
        while any(len(r.response.tokens) < msg[2] for r in streams):
            if any(t.done() for t in w.tasks) or time.monotonic() > deadline:
                conn.send(("warm", "a stream ended (or stalled) before every stream had its first tokens"))
                break
            await asyncio.sleep(0.002)
        else:
            conn.send(("warm", None))
        late = await _recv(conn)
        if late[0] == "stop":  # the parent gave up on this round (a stream ended before it warmed)
            return
        w.start(late[1])
        await asyncio.gather(*w.tasks)
        cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        ticker.cancel()
        conn.send(("results", [(r.key, r.sent_at, r.response) for r in w.results], w.lags, round(cpu, 3)))


def worker_main(conn: multiprocessing.connection.Connection, target: Target) -> None:
    asyncio.run(_serve(conn, target))


class ClientPool:
    """`procs` client processes (spawned: the parent's loop and threads stay out of them); jobs go round-robin.
    `model` None and `path="/generate"`: streams straight to an engine rather than through the router."""

    def __init__(self, url: str, model: str | None, procs: int, *, path: str = ROUTER_PATH,
                 timeout_s: float = 300.0, api_key: str = "") -> None:
        target = Target(url, model, path, timeout_s, api_key)
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child, target), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def _split(self, jobs: list[Job]) -> list[list[Job]]:
        return [jobs[i::len(self.conns)] for i in range(len(self.conns))]

    async def start(self, jobs: list[Job], warm_tokens: int) -> None:
        """Every stream started; returns once each has `warm_tokens` tokens (raises if one ended first)."""
        for conn, part in zip(self.conns, self._split(jobs), strict=True):
            conn.send(("streams", part, warm_tokens))
        errors = [m[1] for m in await asyncio.gather(*(_recv(c) for c in self.conns)) if m[1]]
        if errors:
            raise RuntimeError(f"{errors[0]}; raise max_tokens")

    def send_late(self, jobs: list[Job]) -> None:
        for conn, part in zip(self.conns, self._split(jobs), strict=True):
            conn.send(("late", part))

    async def results(self) -> tuple[dict[int, tuple[float, NdjsonResponse]], list[dict[str, Any]]]:
        """Each stream by key (sent_at, response), and each worker's ticks and CPU share."""
        out: dict[int, tuple[float, NdjsonResponse]] = {}
        workers = []
        for msg in await asyncio.gather(*(_recv(c) for c in self.conns)):
            out.update({k: (sent, resp) for k, sent, resp in msg[1]})
            workers.append({"lags": msg[2], "cpu_share": msg[3]})
        return out, workers

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
