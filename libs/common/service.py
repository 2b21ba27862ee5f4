"""How every service process runs: signals, supervised tasks, a health responder, clean shutdown.

    async def setup(rt: Runtime) -> None:      # connect handlers, start tasks with rt.spawn(...)
        ...
    run_service("agent", settings, setup)

Shutdown (SIGTERM, SIGINT, or the first supervised task that fails) cancels every task, waits for
them with a hard deadline, runs the registered closers in reverse order and exits. A failed task is a
crash on purpose: the supervisor (`holdfast up`, systemd, Kubernetes) restarts the process from durable state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from libs.common import procs, telemetry
from libs.common.accept_trouble import AcceptTrouble
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import HealthReply
from libs.common.security import CredentialsError
from libs.common.store import Store

log = logging.getLogger("holdfast.service")

SHUTDOWN_DEADLINE_S = 5.0
T = TypeVar("T")


def loop_factory(service: str | None = None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop to run on: the stock asyncio loop (None), or uvloop's when it is installed and `HF_UVLOOP`
    is `1` (every service) or names this one (comma-separated: `HF_UVLOOP=router`). Not the default: in the
    control-plane benchmark (2 cores, a microVM) uvloop measured no better than the stock loop
    (docs/history/controlplane-2026-11.md, fourth pass): the CPU goes to pydantic, nats-py's Python protocol code and
    gRPC, not to the loop's own I/O. Nor with TLS (its SSL protocol in Cython): docs/security.md.
    The router alone on uvloop (H200, 64 + 16 streams, 5 kills, one call beside the stock loop, 2026-12-03): the
    kill rounds' largest gap p99 117 against 128 ms, late first token p99 208 against 233; the no-failure round's
    late first token p50 226 against 164 (new clients reached its relay later): mixed, so not the default there
    either (docs/benchmarks.md)."""
    chosen = os.environ.get("HF_UVLOOP", "0").strip()
    if chosen not in ("1", "true", "yes") and (service is None or service not in chosen.split(",")):
        return None
    try:
        import uvloop
    except ImportError:  # a dependency (the engines' HTTP fronts run on it), absent only from a partial install
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def run_loop(main: Coroutine[Any, Any, T], service: str | None = None) -> T:
    """`asyncio.run(main)` on the loop `loop_factory` picks (every service process and the control-plane bench), in
    a process whose descriptor table is sized up front (procs.reserve_fds: a burst of connections or passed fds
    never waits for the kernel to grow it)."""
    procs.reserve_fds()
    with asyncio.Runner(loop_factory=loop_factory(service)) as runner:
        return runner.run(main)


def health_subject(prefix: str, service: str, instance: str) -> str:
    return f"{prefix}.health.{service}.{instance}"


class Runtime:
    """What a service's setup gets: its settings, bus, store, and a way to start supervised tasks."""

    def __init__(self, service: str, instance: str, settings: CommonSettings) -> None:
        self.service = service
        self.instance = instance
        self.settings = settings
        # Set in start(); setup functions run after it, so they always see both.
        self.bus: Bus = None  # type: ignore[assignment]
        self.store: Store = None  # type: ignore[assignment]
        self.stopping = asyncio.Event()
        self.started_at = time.time()
        self.health_detail: Callable[[], dict[str, Any]] = dict
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._closers: list[Callable[[], Awaitable[Any]]] = []
        self.failed: BaseException | None = None
        self.accept = AcceptTrouble(service)

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A named task; if it raises, the service stops (and exits non-zero)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks[name] = task
        task.add_done_callback(self._on_done)
        return task

    def on_close(self, closer: Callable[[], Awaitable[Any]]) -> None:
        self._closers.append(closer)

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.pop(task.get_name(), None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("task %s failed: %r; stopping %s", task.get_name(), exc, self.service, exc_info=exc)
            self.failed = exc
            self.stopping.set()

    async def start(self, *, use_store: bool = True) -> None:
        self.accept.install(asyncio.get_running_loop())  # the HTTP servers' failed accepts: one line an episode
        self.bus = await Bus.connect(self.settings, f"{self.service}:{self.instance}")
        if use_store:
            # however long etcd is stalled or restarting (NATS's connect waits so too): a service started meanwhile
            # outlives it rather than exiting into its supervisor's restart backoff
            self.store = await Store.connect(self.settings, source=f"{self.service}:{self.instance}", timeout=None)

    async def announce_health(self) -> None:
        """Answer health requests; called after setup, so "healthy" means every handler is registered."""

        async def health(_: bytes) -> bytes:
            trouble = self.accept.trouble  # it serves no new client meanwhile: not ok
            reply = HealthReply(service=self.service, instance=self.instance,
                                ok=not self.stopping.is_set() and trouble is None,
                                detail={"uptime_s": round(time.time() - self.started_at, 3), "pid": os.getpid(),
                                        "rejected": self.bus.rejected, "accept_trouble": trouble,
                                        "failed_accepts": self.accept.total, **self.health_detail()})
            return reply.model_dump_json().encode()

        prefix = self.settings.subject_prefix
        await self.bus.serve_raw(health_subject(prefix, self.service, self.instance), health)
        # Also on the bare service subject: whoever runs one instance can ask without knowing its name.
        await self.bus.serve_raw(f"{prefix}.health.{self.service}", health)
        await self.bus.settle()  # both subscriptions at the server before the service says it is up

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=SHUTDOWN_DEADLINE_S)
        for closer in reversed(self._closers):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(closer(), timeout=SHUTDOWN_DEADLINE_S)
        if self.bus is not None:
            await self.bus.close()
        if self.store is not None:
            await self.store.close()


async def serve_until_stopped(rt: Runtime, setup: Callable[[Runtime], Awaitable[None]], *, use_store: bool = True) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.stopping.set)
    try:
        await rt.start(use_store=use_store)
        await setup(rt)
        await rt.announce_health()
        log.info("%s %s ready (pid %d)", rt.service, rt.instance, os.getpid())
        await rt.stopping.wait()
    finally:
        await rt.close()
    return 1 if rt.failed else 0


def run_service(service: str, instance: str, settings: CommonSettings,
                setup: Callable[[Runtime], Awaitable[None]], *, use_store: bool = True) -> None:
    telemetry.setup(service, instance=instance, otel_endpoint=settings.otel_endpoint,
                    log_level=settings.log_level, log_json=settings.log_json)
    rt = Runtime(service, instance, settings)
    try:
        code = run_loop(serve_until_stopped(rt, setup, use_store=use_store), service)
    except CredentialsError as e:  # missing or expired, said plainly, no traceback: the operator's fix is in the message
        log.error("%s cannot start: %s", service, e.message)
        code = 2
    sys.exit(code)


async def check_health(bus: Bus, service: str, instance: str | None = None, timeout: float = 1.0) -> HealthReply:
    subject = health_subject(bus.prefix, service, instance) if instance else f"{bus.prefix}.health.{service}"
    msg = await bus.nc.request(subject, b"", timeout=timeout)
    return HealthReply.model_validate_json(msg.data)
