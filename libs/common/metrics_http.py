"""`GET /metrics` (Prometheus text) of one registry on its own port, off the event loop.

prometheus_client's server runs in a daemon thread: a scrape never waits for the service's loop, and the loop
never waits for a scrape. Collectors therefore run on that thread; they read the service's tables by copying
them first (`list(d.values())` is one step under the GIL), never by iterating a live dict.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, start_http_server

from libs.common.service import Runtime


def serve_metrics(rt: Runtime, registry: CollectorRegistry, host: str, port: int | None) -> int | None:
    """Serve `registry` on host:port (0: a free port) until the runtime closes; the port, or None when off."""
    if port is None:
        return None
    server, thread = start_http_server(port, addr=host, registry=registry)

    async def stop() -> None:
        server.shutdown()  # ends serve_forever, then the socket goes
        server.server_close()
        await asyncio.to_thread(thread.join, 2.0)

    rt.on_close(stop)
    return int(server.server_port)
