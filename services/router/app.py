"""Wiring: endpoint events and the etcd level into the table, the relay, the HTTP server behind its guard.

Start-up order matters: subscribe first (buffering), then read the snapshot of `endpoints/<model>/<engine>`,
apply it, then apply the buffered events in order. An event that raced the snapshot is therefore applied
after it, never lost or undone. Then `keep_in_sync` re-reads that level on every NATS reconnect and every
`reconcile_s` (sync.py), so events missed while NATS was away are made up for.

The HTTP API is behind the guard every Holdfast API shares (libs/common/web/guard.py): where keys are asked for
(`api_keys`), a client without one gets 401, and any body over `max_body_bytes` 413, from the headers, before a
byte of the body is read; only `/healthz` is public.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl

import httpcore
import httpx
import uvicorn

from libs.common.gc_tuning import count_pauses, long_lived_gc
from libs.common.loop_watch import LoopWatch
from libs.common.metrics_http import serve_metrics
from libs.common.service import Runtime
from libs.common.web.guard import RequestGuard
from libs.common.web.intake import Intake
from libs.common.web.keyfile import token_file
from libs.common.web.linger import LingerStats, lingering_h11
from libs.common.web.tokens import ROUTER_SCOPES, TokenTable
from services.router.api import PUBLIC, Workers, build_app, refusal
from services.router.metrics import MeteredRelay, RouterMetrics
from services.router.settings import RouterSettings
from services.router.spare import SpareBackend
from services.router.sync import EndpointFeed, Level, keep_in_sync
from services.router.table import EndpointTable
from services.router.workers import WorkerPool, listen

log = logging.getLogger("holdfast.router")


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the service runner owns SIGTERM/SIGINT; `serving` is set once it
    listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.serving = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.serving.set()


def api_keys(settings: RouterSettings) -> TokenTable | None:
    """The keys clients must present, or None when anonymous clients are allowed: configured keys are always asked
    for; with none, a router on loopback serves anonymous clients unless told otherwise (there the node's users
    reach the engines' own ports anyway: docs/security.md), one on any other address makes a key into its state dir
    unless `allow_anonymous` says to serve anyone."""
    spec = settings.api_keys
    if settings.api_keys_file is not None:
        spec += "\n" + settings.api_keys_file.read_text()
    keys = TokenTable.parse(spec, ROUTER_SCOPES).with_token(settings.api_key, "infer")
    if keys.entries:
        if settings.allow_anonymous:
            raise ValueError("allow_anonymous and API keys are both set: say which (keys, or no key asked for)")
        return keys
    anonymous = settings.allow_anonymous if settings.allow_anonymous is not None else loopback(settings.router_host)
    if anonymous:
        log.warning("router: no API key asked for: anyone who reaches %s may send requests", settings.router_host)
        return None
    return keys.with_token(token_file(settings.ensure_state_dir() / "router-api-key", "the router's API key"), "infer")


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def setup(rt: Runtime, settings: RouterSettings, argv: list[str] | None = None) -> None:
    """`argv`: the router's own flags, which workers 1..N-1 are started with too (workers.py)."""
    keys = api_keys(settings)  # before anything is started: a bad key file ends the start
    table = EndpointTable(settings.queue_max, forget_s=settings.model_forget_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=settings.engine_keepalive_connections,
                          keepalive_expiry=settings.engine_keepalive_s)
    # connections to engines opened ahead of need (spare.py): the pool's network backend, which httpx takes no
    # argument for, so the transport's pool is built here with it
    spares = SpareBackend(settings.engine_spare_connections, max_age_s=settings.engine_keepalive_s,
                          connect_timeout_s=settings.connect_timeout_s)
    transport = httpx.AsyncHTTPTransport(limits=limits)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=ssl.create_default_context(), max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
        network_backend=spares)
    client = httpx.AsyncClient(transport=transport,
                               timeout=httpx.Timeout(settings.token_timeout_s, connect=settings.connect_timeout_s))
    rt.on_close(client.aclose)
    rt.on_close(spares.close)
    metrics = RouterMetrics()
    relay = MeteredRelay(table, client, settings, ttft=metrics.ttft)
    metrics.watch(relay.stats)
    feed = EndpointFeed(table, relay, grace_s=settings.reconcile_grace_s, recovery_hold_s=settings.recovery_hold_s)
    feed.on_standby = spares.top_up  # a failover's requests find connections open to the successor (spare.py)

    async def level() -> Level:
        """The endpoints (with their mod revisions) and the recoveries under way (sync.py), one request a prefix."""
        endpoints = await rt.store.get_prefix_with_revisions("endpoints/")
        return Level({**{k: v for k, (v, _) in endpoints.items()}, **await rt.store.get_prefix("recoveries/")},
                     {k: rev for k, (_, rev) in endpoints.items()})

    async def read_level() -> Level:
        return await asyncio.wait_for(level(), timeout=settings.reconcile_read_timeout_s)

    await rt.bus.subscribe("router.endpoint.added", feed.on_event)
    await rt.bus.subscribe("router.endpoint.removed", feed.on_event)
    await rt.bus.subscribe("router.endpoint.unrecovered", feed.on_event)
    await rt.bus.subscribe("router.endpoint.standby", feed.on_event)
    n = feed.load_snapshot(await level())
    feed.go_live()
    log.info("router %s: %d endpoints from the snapshot", settings.instance, n)
    rt.spawn("endpoint-sync", keep_in_sync(feed, read_level, rt.bus.nc, period_s=settings.reconcile_s))
    rt.spawn("spare-connections", spares.keep(feed.spare_urls, period_s=1.0))

    listeners = await listen(settings)  # this worker's socket on the public port, and its own stats port
    pool: WorkerPool | None = None
    if settings.router_worker_index == 0 and settings.router_workers > 1:
        pool = WorkerPool(settings, listeners, argv or [])
        rt.on_close(pool.stop)
    port = listeners.port
    watch = LoopWatch(settings.router_loop_watch_ms / 1000) if settings.router_loop_watch_ms > 0 else None
    if watch is not None:
        rt.spawn("loop-watch", watch.run())
    workers = Workers(listeners.index, listeners.stats_urls(settings.router_host))
    if settings.router_workers > 1:  # /stats asks the other workers (not through the engines' pool)
        workers.client = httpx.AsyncClient()
        rt.on_close(workers.client.aclose)
    app = build_app(relay, table, lambda: feed.ready, feed.stats.as_dict, watch, spares=spares, workers=workers,
                    max_context=settings.max_context_tokens)
    # new requests a slice of the loop a pass (libs/common/web/intake.py): a burst of them, refusals included, runs
    # between the streams' lines rather than before all of them
    intake = Intake(app, exempt=PUBLIC)  # the liveness probe never waits behind a burst
    guard = RequestGuard(intake, tokens=keys, max_body_bytes=settings.max_body_bytes, public=PUBLIC, refusal=refusal)
    linger = LingerStats()
    # lifespan off: the app has no startup or shutdown of its own, and a lifespan task cancelled at shutdown logged
    # a CancelledError traceback at ERROR on every stop
    server = QuietServer(uvicorn.Config(guard, log_level="warning", access_log=False, timeout_keep_alive=30,
                                        lifespan="off", http=lingering_h11(settings.linger_max_bytes, settings.linger_max_s, linger,
                                                           settings.header_timeout_s, settings.body_timeout_s,
                                                           refusal)))
    # workers 1..N-1 serve their metrics on a free port of their own (in their health's metrics_port)
    metrics_port = serve_metrics(rt, metrics.registry, settings.metrics_host,
                                 0 if settings.router_worker_index and settings.metrics_port else settings.metrics_port)
    rt.health_detail = lambda: {"url": f"http://{settings.router_host}:{port}", **relay.stats.as_dict(),
                                "metrics_port": metrics_port, "auth": keys is not None,
                                "refused": dict(guard.refused), "lingered": vars(linger), "intake": intake.stats(),
                                "endpoints": table.describe(), "sync": feed.stats.as_dict(),
                                "spare_connections": spares.stats(), "worker": listeners.index,
                                "workers": pool.describe() if pool is not None else None}

    async def serve_http() -> None:
        await server.serve(sockets=listeners.sockets())
        if not rt.stopping.is_set():
            raise RuntimeError("the router's HTTP server stopped")

    async def stop_http() -> None:
        server.should_exit = True
        await asyncio.sleep(0)

    # What lives now (FastAPI, pydantic, httpx: most of the heap) lives as long as the router: frozen out of the
    # collector's walks. Without it a full collection held the loop 20-40 ms at a time right after an engine's kill
    # (H200, 64 + 16 streams: the loop late 100-185 ms in the 250 ms after it), delaying the successor's route-in.
    long_lived_gc()
    count_pauses()
    rt.spawn("http", serve_http())
    if pool is not None:  # once this worker serves: a router started again serves as soon as one process can
        for i in range(1, settings.router_workers):
            rt.spawn(f"router-worker-{i}", pool.keep(i, after=server.serving))
    rt.on_close(stop_http)
    log.info("router listening on http://%s:%d", settings.router_host, port)
