"""Wiring: endpoint events and the etcd snapshot into the table, the relay, the HTTP server.

Start-up order matters: subscribe first (buffering), then read the snapshot of `endpoints/<model>/<engine>`,
apply it, then apply the buffered events in order. An event that raced the snapshot is therefore applied
after it, never lost or undone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any

import httpx
import uvicorn

from libs.common.events import EndpointAdded, EndpointRemoved, Envelope
from libs.common.service import Runtime
from services.router.api import build_app
from services.router.relay import Relay
from services.router.settings import RouterSettings
from services.router.table import EndpointTable

log = logging.getLogger("holdfast.router")


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the service runner owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


class EndpointFeed:
    """Applies endpoint events to the table (and cuts the streams of removed engines)."""

    def __init__(self, table: EndpointTable, relay: Relay) -> None:
        self.table = table
        self.relay = relay
        self.ready = False
        self._buffer: list[Envelope] = []

    async def on_event(self, env: Envelope) -> None:
        if not self.ready:
            self._buffer.append(env)
            return
        self.apply(env.data)

    def apply(self, ev: Any) -> None:
        if isinstance(ev, EndpointAdded):
            self.table.add(ev.model, ev.engine_id, ev.url)
            log.info("endpoint added: %s %s %s (predecessor %s)", ev.model, ev.engine_id, ev.url, ev.predecessor_id)
            if ev.predecessor_id and ev.predecessor_id != ev.engine_id:
                self._gone(ev.model, ev.predecessor_id)
        elif isinstance(ev, EndpointRemoved):
            log.info("endpoint removed: %s %s (%s)", ev.model, ev.engine_id, ev.reason)
            self._gone(ev.model, ev.engine_id)

    def _gone(self, model: str, engine_id: str) -> None:
        self.table.remove(model, engine_id)
        cut = self.relay.endpoint_gone(engine_id)
        if cut:
            log.info("%d streams on %s will resume on another endpoint", cut, engine_id)

    def load_snapshot(self, kvs: dict[str, bytes]) -> int:
        n = 0
        for key, raw in kvs.items():
            rest = key.removeprefix("endpoints/")
            model, _, engine_id = rest.rpartition("/")
            try:
                value = json.loads(raw)
            except ValueError:
                log.warning("ignoring malformed endpoint record %s", key)
                continue
            url = value.get("url") if isinstance(value, dict) else None
            if not model or not engine_id or not url:
                log.warning("ignoring endpoint record %s without model, engine or url", key)
                continue
            self.table.add(str(value.get("model") or model), engine_id, str(url))
            n += 1
        return n

    def go_live(self) -> None:
        for env in self._buffer:  # no await in here: nothing can slip in between
            self.apply(env.data)
        self._buffer.clear()
        self.ready = True


async def setup(rt: Runtime, settings: RouterSettings) -> None:
    table = EndpointTable(settings.queue_max)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(settings.token_timeout_s, connect=settings.connect_timeout_s))
    rt.on_close(client.aclose)
    relay = Relay(table, client, settings)
    feed = EndpointFeed(table, relay)

    await rt.bus.subscribe("router.endpoint.added", feed.on_event)
    await rt.bus.subscribe("router.endpoint.removed", feed.on_event)
    n = feed.load_snapshot(await rt.store.get_prefix("endpoints/"))
    feed.go_live()
    log.info("router %s: %d endpoints from the snapshot", settings.instance, n)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.router_host, settings.router_port))
    port = sock.getsockname()[1]
    server = QuietServer(uvicorn.Config(build_app(relay, table, lambda: feed.ready), log_level="warning",
                                        access_log=False, timeout_keep_alive=30))
    rt.health_detail = lambda: {"url": f"http://{settings.router_host}:{port}", **relay.stats.as_dict(),
                                "endpoints": table.describe()}

    async def serve_http() -> None:
        await server.serve(sockets=[sock])
        if not rt.stopping.is_set():
            raise RuntimeError("the router's HTTP server stopped")

    async def stop_http() -> None:
        server.should_exit = True
        await asyncio.sleep(0)

    rt.spawn("http", serve_http())
    rt.on_close(stop_http)
    log.info("router listening on http://%s:%d", settings.router_host, port)
