"""Wiring: endpoint events and the etcd level into the table, the relay, the HTTP server.

Start-up order matters: subscribe first (buffering), then read the snapshot of `endpoints/<model>/<engine>`,
apply it, then apply the buffered events in order. An event that raced the snapshot is therefore applied
after it, never lost or undone. Then `keep_in_sync` re-reads that level on every NATS reconnect and every
`reconcile_s` (sync.py), so events missed while NATS was away are made up for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import httpx
import uvicorn

from libs.common.metrics_http import serve_metrics
from libs.common.service import Runtime
from services.router.api import build_app
from services.router.metrics import MeteredRelay, RouterMetrics
from services.router.settings import RouterSettings
from services.router.sync import EndpointFeed, keep_in_sync
from services.router.table import EndpointTable

log = logging.getLogger("holdfast.router")


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the service runner owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


async def setup(rt: Runtime, settings: RouterSettings) -> None:
    table = EndpointTable(settings.queue_max, forget_s=settings.model_forget_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(settings.token_timeout_s, connect=settings.connect_timeout_s))
    rt.on_close(client.aclose)
    metrics = RouterMetrics()
    relay = MeteredRelay(table, client, settings, ttft=metrics.ttft)
    metrics.watch(relay.stats)
    feed = EndpointFeed(table, relay, grace_s=settings.reconcile_grace_s)

    async def read_endpoints() -> dict[str, bytes]:
        return await asyncio.wait_for(rt.store.get_prefix("endpoints/"), timeout=settings.reconcile_read_timeout_s)

    await rt.bus.subscribe("router.endpoint.added", feed.on_event)
    await rt.bus.subscribe("router.endpoint.removed", feed.on_event)
    n = feed.load_snapshot(await rt.store.get_prefix("endpoints/"))
    feed.go_live()
    log.info("router %s: %d endpoints from the snapshot", settings.instance, n)
    rt.spawn("endpoint-sync", keep_in_sync(feed, read_endpoints, rt.bus.nc, period_s=settings.reconcile_s))

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.router_host, settings.router_port))
    port = sock.getsockname()[1]
    server = QuietServer(uvicorn.Config(build_app(relay, table, lambda: feed.ready, feed.stats.as_dict), log_level="warning",
                                        access_log=False, timeout_keep_alive=30))
    metrics_port = serve_metrics(rt, metrics.registry, settings.metrics_host, settings.metrics_port)
    rt.health_detail = lambda: {"url": f"http://{settings.router_host}:{port}", **relay.stats.as_dict(),
                                "metrics_port": metrics_port,
                                "endpoints": table.describe(), "sync": feed.stats.as_dict()}

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
