"""Shared by the controller and dc_manager tests: service processes, a span collector, waiting on etcd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

from devstack.simcluster import SimulatedCluster
from libs.common import procs
from libs.common.bus import Bus
from libs.common.events import Envelope
from libs.common.service import check_health
from libs.common.store import Store

T = TypeVar("T")


def start(module: str, env: dict[str, str], log_path: Path, **extra: str) -> procs.Child:
    full = {**env, "HF_LOG_LEVEL": "INFO", "OTEL_BSP_SCHEDULE_DELAY": "100", **extra}
    return procs.Child(module, [sys.executable, "-m", module], env=full, log_path=log_path).start()


async def wait_for(probe: Callable[[], Awaitable[T | None]], timeout: float = 20.0, what: str = "condition") -> T:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = await probe()
        if got:
            return got
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def serving_cluster(bus: Bus, store: Store, *, nodes: int, gpus_per_node: int,
                          ready_gate: asyncio.Event | None = None,
                          takeover_gate: asyncio.Event | None = None) -> SimulatedCluster:
    """A simulated cluster answering node commands, with the `sim` engine class's spec recorded (what a cold
    start needs). The gates, when given, hold its cold engines' readiness and its takeovers."""
    sim = SimulatedCluster(bus, store, nodes=nodes, gpus_per_node=gpus_per_node)
    if ready_gate is not None:
        sim.ready_gate = ready_gate
    if takeover_gate is not None:
        sim.takeover_gate = takeover_gate
    await sim.populate()
    await sim.serve()
    await store.put("specs/sim", {"engine_class": "sim", "model": "m", "command": ["engine"]})
    return sim


async def collected(bus: Bus, *kinds: str) -> list[Envelope]:
    """Every event of `kinds` published from now on, in arrival order (a list the subscriptions append to)."""
    seen: list[Envelope] = []

    async def on_event(env: Envelope) -> None:
        seen.append(env)

    for kind in kinds:
        await bus.subscribe(kind, on_event)
    return seen


async def healthy(bus: Bus, service: str, instance: str, timeout: float = 30.0) -> None:
    async def probe() -> bool:
        try:
            await check_health(bus, service, instance, timeout=0.3)
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    await wait_for(probe, timeout, f"{service} {instance} healthy")


class SpanSink:
    """A minimal OTLP/HTTP trace receiver: what the service processes export lands in `spans`."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        with self.lock:
            for rs in req.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({"name": s.name, "trace_id": s.trace_id.hex(), "service": service,
                                           "start": s.start_time_unix_nano, "end": s.end_time_unix_nano})

    def in_trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


@contextmanager
def span_sink() -> Iterator[tuple[SpanSink, str]]:
    sink = SpanSink()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path.endswith("/v1/traces"):
                sink.add(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield sink, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def service_env(settings_env: dict[str, str], **extra: str) -> dict[str, str]:
    return {**settings_env, "HF_API_ENABLED": "false", "PYTHONPATH": os.getcwd(), **extra}


@contextlib.asynccontextmanager
async def control_plane(bus: Bus, store: Any, env: dict[str, str], log_dir: Path,
                        controllers: tuple[str, ...] = ("c1",), dc_manager: bool = True) -> AsyncIterator[dict[str, procs.Child]]:
    """Start controllers (the first one leads) and a dc_manager; stop them all on exit."""
    children: dict[str, procs.Child] = {}
    try:
        for i, name in enumerate(controllers):
            children[name] = start("services.controller", env, log_dir / f"{name}.log", HF_INSTANCE=name)
            await healthy(bus, "controller", name)
            if i == 0:
                await wait_for(lambda: store.get("leader/controller"), what="a leader")
        if dc_manager:
            children["dcm"] = start("services.dc_manager", env, log_dir / "dcm.log")
            await healthy(bus, "dc_manager", env.get("HF_DATACENTER", "dc-1"))
        yield children
    finally:
        for child in children.values():
            child.stop()
