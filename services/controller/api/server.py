"""`ApiThread`: the admin API served on a thread of its own, with its own event loop, etcd and NATS connections
and its own view of the cluster, so that no request is accepted, parsed, validated or encoded on the loop of the
incident pipeline.

Why not on the pipeline's loop: a request's work (HTTP parsing, up to `api_max_body_bytes` of JSON, pydantic,
the response's JSON) runs between two of the pipeline's callbacks; a steady stream of requests put every step of
every incident behind them (issue 18: fault-to-resolved went from 54 ms to 120-200 ms under three attacker loops).
On its own loop the API can only take CPU time from the pipeline, never hold its place in a queue.

What crosses between the two threads, and why each is safe:
- the listening socket, bound by the caller before the thread starts (the port is known and bind errors surface
  in setup), then used by this thread only;
- `is_leader` (reads one bool) and `metrics` (prometheus_client's metrics lock their values; the view gauges copy
  the pipeline view's dicts in one C call each before reading them);
- nothing else: the view is this thread's own (`ClusterView.follow` on this thread's `Store`), admin actions are
  etcd writes (an on-purpose incident is a record the leader picks up) or node commands over this thread's `Bus`.

Invariants: the thread's loop is the only one that touches its view, store and bus; `ready` is set only once the
view is synced and uvicorn listens; a failure of the thread ends `run()` with that failure (the service stops, its
supervisor restarts it, as when the API was a task of the main loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import uvicorn

from libs.common.bus import Bus
from libs.common.service import run_loop
from libs.common.store import Store
from libs.common.web.linger import LingerStats, lingering_h11
from libs.common.web.tokens import TokenTable
from services.controller.api.app import create_app
from services.controller.api.context import ApiContext
from services.controller.metrics import ControllerMetrics
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.api")

SYNC_TIMEOUT_S = 30.0  # the API thread's view must load within this (as the main view must)
STOP_DEADLINE_S = 5  # open requests get this long to finish when the service stops


class ApiServer(uvicorn.Server):
    """uvicorn inside a service: the service runner owns the signals, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class ApiThread:
    """The admin API on its own thread and loop. `await run()` from the main loop: it returns when the API
    stops and raises what ended it; cancelling it stops the API (open requests get `STOP_DEADLINE_S`)."""

    def __init__(self, settings: ControllerSettings, sock: socket.socket, metrics: ControllerMetrics,
                 is_leader: Callable[[], bool], admin_token: str) -> None:
        self.settings = settings
        self.sock = sock
        self.metrics = metrics
        self.linger = LingerStats()  # refused bodies dropped while their connections closed (linger.py)
        self.is_leader = is_leader
        # Hashed here, once: the thread keeps digests, not the plain dev token (tokens.py).
        self.tokens = TokenTable.parse(settings.api_tokens).with_plain(admin_token, settings.read_token)
        self.ready: Future[None] = Future()  # resolved on the API thread; awaited on the main loop
        self.done: Future[None] = Future()
        self._server: ApiServer | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="controller-api", daemon=True)

    def start(self) -> None:
        self._thread.start()

    async def wait_ready(self, timeout: float = SYNC_TIMEOUT_S + 10.0) -> None:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.ready)), timeout)

    async def run(self) -> None:
        """The API's lifetime seen from the main loop (a supervised task of the service)."""
        try:
            await asyncio.shield(asyncio.wrap_future(self.done))
        except asyncio.CancelledError:
            self.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.wrap_future(self.done), STOP_DEADLINE_S + 2.0)
            raise

    def stop(self) -> None:
        """Thread-safe: uvicorn polls `should_exit` on its own loop (every 0.1 s)."""
        self._stop.set()
        if self._server is not None:
            self._server.should_exit = True

    def _main(self) -> None:
        try:
            run_loop(self._serve())
        except BaseException as e:  # noqa: BLE001 - handed to the main loop, which stops the service
            if not self.ready.done():
                self.ready.set_exception(e)
            self.done.set_exception(e)
        else:
            if not self.ready.done():
                self.ready.set_exception(RuntimeError("the admin API stopped before it was ready"))
            self.done.set_result(None)

    async def _serve(self) -> None:
        s = self.settings
        store = await Store.connect(s, source=f"controller-api:{s.instance}", timeout=None)  # as the service's own
        bus = await Bus.connect(s, f"controller-api:{s.instance}", stream=False)
        view = ClusterView()
        follow = asyncio.create_task(view.follow(store), name="api-view")
        try:
            synced = asyncio.create_task(view.synced.wait())
            await asyncio.wait([synced, follow], timeout=SYNC_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            if follow.done():
                follow.result()  # the watch failed: raise its error
            if not synced.done():
                synced.cancel()
                raise TimeoutError(f"the API's view did not load from etcd within {SYNC_TIMEOUT_S} s")
            ctx = ApiContext(settings=s, view=view, store=store, bus=bus, metrics=self.metrics,
                             is_leader=self.is_leader, tokens=self.tokens)
            config = uvicorn.Config(create_app(ctx), log_level="warning", access_log=False, lifespan="on",
                                    timeout_graceful_shutdown=STOP_DEADLINE_S,
                                    http=lingering_h11(s.api_linger_max_bytes, s.api_linger_max_s, self.linger,
                                                      s.api_header_timeout_s, s.api_body_timeout_s))
            self._server = server = ApiServer(config)
            if self._stop.is_set():
                return
            serving = asyncio.create_task(server.serve(sockets=[self.sock]), name="api-serve")
            while not server.started and not serving.done():  # noqa: ASYNC110 - uvicorn has no started event
                await asyncio.sleep(0.01)
            if server.started:
                self.ready.set_result(None)
            done, _ = await asyncio.wait([serving, follow], return_when=asyncio.FIRST_COMPLETED)
            if follow in done:  # the view's watch ended: the API would answer from a stale view
                server.should_exit = True
                await serving
                follow.result()
                raise RuntimeError("the API's view stopped following etcd")
            serving.result()
        finally:
            follow.cancel()
            with contextlib.suppress(BaseException):
                await follow
            await bus.close()
            await store.close()
