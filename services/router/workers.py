"""Several router processes behind one port (`router_workers` N > 1; by default one per 4 cores): each a whole
router, each its own event loop.

One router process relays every token line of every stream on one Python event loop; at 64 streams of a batched
engine that loop is busy most of the time, and a new request waits for it (docs/benchmarks.md, "where a late
request's first token goes"). N workers split the streams.

- Worker 0 is the process the supervisor started. It binds the public port, and one private loopback socket a
  worker (port 0: each worker's own address, for its own `/stats`), then starts workers 1..N-1
  (`python -m services.router`, its own flags and environment, plus `HF_ROUTER_WORKER_*`) once it serves itself (a
  router started again after a crash serves as soon as one process can), handing each a socket of
  its own bound to the public port (SO_REUSEPORT) and its private one, as inherited descriptors: no worker binds
  anything, none races for a port.
- The kernel spreads new connections over the workers' public sockets by their addresses' hash: a burst is not
  taken whole by the first loop to wake (one socket shared by every worker was: asyncio accepts every queued
  connection at each wake-up). A worker's socket listens only once it serves, and leaves the group when it exits
  (worker 0 keeps no copy), so no connection waits on a dead worker. A client's kept-alive connection stays with
  its worker. Each worker is a full router: its own bus and store connections, endpoint table, relay, spare
  connections (`engine_spare_connections` is per worker), held-request queue (`queue_max` per worker). Its bus
  instance is `<instance>-w<i>` (worker 0 keeps `<instance>`).
- One unit: workers 1..N-1 die with worker 0 (PR_SET_PDEATHSIG, checked against the parent's pid at start); worker
  0 starts again a worker that exits while the router runs (after `RESTART_DELAY_S`, doubled while it keeps exiting
  soon after its start; its streams were cut with it, the others' go on), and stops them all (SIGTERM, then SIGKILL
  after the deadline) when it stops. A router that finds its port held (a predecessor's single process or
  workers, dying) tries again for up to `BIND_WAIT_S`.
- `GET /stats` on any worker answers for the whole router (`merge_stats`: counters summed, recent lists joined) and
  lists each worker's own `/stats` address; `?scope=worker` answers for the worker alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from libs.common.backoff import Backoff
from services.router.settings import RouterSettings

log = logging.getLogger("holdfast.router.workers")

RESTART_DELAY_S = 1.0  # a worker that exits is started again after this, doubled while it keeps exiting soon
RESTART_MAX_DELAY_S = 30.0
BIND_WAIT_S = 3.0
STOP_DEADLINE_S = 5.0
PR_SET_PDEATHSIG = 1

# /stats keys kept from the answering worker (each worker's view of the same thing), not summed or joined
OWN_KEYS = frozenset({"endpoints", "sync", "gc_frozen", "worker", "pid"})


@dataclass
class Listeners:
    """The sockets this worker serves on: its own on the public port and its private one on loopback (None with
    one worker), and every worker's private port, in worker order."""

    public: socket.socket
    own: socket.socket | None
    ports: list[int]
    index: int
    siblings: list[socket.socket]  # worker 0's: workers 1..N-1's private sockets, to hand on

    @property
    def port(self) -> int:
        return int(self.public.getsockname()[1])

    def stats_urls(self, host: str) -> list[str]:
        return [f"http://{_url_host(loopback_of(host))}:{p}/stats" for p in self.ports]

    def sockets(self) -> list[socket.socket]:
        return [self.public] if self.own is None else [self.public, self.own]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def loopback_of(host: str) -> str:
    """The loopback address of `host`'s family: where the workers' private ports listen, whatever the public
    address (a router serving on every interface shows no worker's own port beyond the machine)."""
    return "::1" if ":" in host else "127.0.0.1"


def _bind(host: str, port: int, *, shared: bool = False) -> socket.socket:
    """A TCP socket bound to (host, port); `shared`: SO_REUSEPORT, so that each worker binds a socket of its own to
    the one port (sockets of one user only: the kernel refuses another's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


async def _bind_public(host: str, port: int, wait_s: float = BIND_WAIT_S, *, shared: bool = False) -> socket.socket:
    """Worker 0's public socket; a port still held (EADDRINUSE) is tried again for up to `wait_s`: a router started
    right after its predecessor's SIGKILL finds the port held by that one's workers until they are gone too (they
    die with it, a few milliseconds later)."""
    deadline = time.monotonic() + wait_s
    backoff = Backoff(first_s=0.02, max_s=0.25)
    while True:
        try:
            return _bind(host, port, shared=shared)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or port == 0 or time.monotonic() >= deadline:
                raise
            log.info("router port %d still held; trying again", port)
            await asyncio.sleep(backoff.next_delay())


async def listen(settings: RouterSettings) -> Listeners:
    """Worker 0 binds its public socket and (N > 1) one private socket a worker; worker i > 0 takes its public
    socket (bound by worker 0 to the same port for it, SO_REUSEPORT) and its private one from the descriptors
    worker 0 handed it."""
    if settings.router_worker_index > 0:
        public_fd, own_fd = (int(x) for x in settings.router_worker_fds.split(","))
        ports = [int(p) for p in settings.router_worker_ports.split(",")]
        return Listeners(socket.socket(fileno=public_fd), socket.socket(fileno=own_fd), ports,
                         settings.router_worker_index, [])
    several = settings.router_workers > 1
    public = await _bind_public(settings.router_host, settings.router_port, shared=several)
    if not several:
        return Listeners(public, None, [], 0, [])
    own = [_bind(loopback_of(settings.router_host), 0) for _ in range(settings.router_workers)]
    return Listeners(public, own[0], [int(s.getsockname()[1]) for s in own], 0, own[1:])


def die_with_parent(parent_pid: int) -> None:
    """A worker i > 0, at its start: killed when worker 0 dies; and gone at once if it already has."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        raise SystemExit(f"router worker: its parent {parent_pid} is gone")


def worker_instance(instance: str, index: int) -> str:
    return instance if index == 0 else f"{instance}-w{index}"


class WorkerPool:
    """Worker 0's workers 1..N-1: started, started again when one exits, stopped with worker 0."""

    def __init__(self, settings: RouterSettings, listeners: Listeners, argv: list[str]) -> None:
        self.settings = settings
        self.port = listeners.port
        self.own = listeners.siblings
        self.ports = listeners.ports
        self.argv = argv
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self._stopping = False

    async def _start(self, index: int) -> asyncio.subprocess.Process:
        own = self.own[index - 1]
        # its own socket on the public port, bound here (the port is known, the worker needs no rights to bind it)
        # and not listening until the worker serves; closed here once handed on, so that the kernel stops giving it
        # connections when the worker exits
        public = _bind(self.settings.router_host, self.port, shared=True)
        try:
            env = {**os.environ, "HF_ROUTER_WORKER_INDEX": str(index),
                   "HF_ROUTER_WORKERS": str(self.settings.router_workers), "HF_INSTANCE": self.settings.instance,
                   "HF_ROUTER_WORKER_FDS": f"{public.fileno()},{own.fileno()}",
                   "HF_ROUTER_WORKER_PORTS": ",".join(map(str, self.ports)),
                   "HF_ROUTER_PARENT_PID": str(os.getpid())}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.router", *self.argv, env=env, stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(public.fileno(), own.fileno()))
        finally:
            public.close()
        self.procs[index] = proc
        log.info("router worker %d started (pid %d)", index, proc.pid)
        return proc

    async def keep(self, index: int, after: asyncio.Event | None = None) -> None:
        """Worker `index` runs while the router does, first started once `after` is set (worker 0 serves), then
        again after it exits, after a delay that grows while it keeps exiting soon after its start."""
        if after is not None:
            await after.wait()
        backoff = Backoff(first_s=RESTART_DELAY_S, max_s=RESTART_MAX_DELAY_S)
        while not self._stopping:
            started = time.monotonic()
            proc = await self._start(index)
            code = await proc.wait()
            if self._stopping:
                return
            if time.monotonic() - started > RESTART_MAX_DELAY_S:
                backoff.reset()
            delay = backoff.next_delay()
            log.error("router worker %d (pid %d) exited %s; starting it again in %.1f s", index, proc.pid, code, delay)
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        self._stopping = True
        live = [p for p in self.procs.values() if p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        if live:
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=STOP_DEADLINE_S)
            for p in live:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            for t in pending:
                with contextlib.suppress(Exception):
                    await t

    def describe(self) -> list[dict[str, Any]]:
        return [{"worker": i, "pid": p.pid, "alive": p.returncode is None} for i, p in sorted(self.procs.items())]


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole router's `/stats` from its workers' (the answering worker's first): numbers summed, lists joined,
    dicts merged the same way key by key, `OWN_KEYS` and anything else kept from the first."""
    if not parts:
        return {}
    out: dict[str, Any] = {}
    for key, mine in parts[0].items():
        others = [p[key] for p in parts[1:] if key in p]
        out[key] = mine if key in OWN_KEYS else _merge(mine, others)
    return out


def _merge(mine: Any, others: list[Any]) -> Any:
    if isinstance(mine, bool) or mine is None:
        return mine
    if isinstance(mine, int | float):
        total = mine + sum(o for o in others if isinstance(o, int | float) and not isinstance(o, bool))
        return round(total, 4) if isinstance(total, float) else total
    if isinstance(mine, list):
        return mine + [x for o in others if isinstance(o, list) for x in o]
    if isinstance(mine, dict):
        return {k: _merge(v, [o[k] for o in others if isinstance(o, dict) and k in o]) for k, v in mine.items()}
    return mine

