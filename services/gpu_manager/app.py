"""Wiring: backend, lease table, keeper, mirror, the engine socket, NATS commands and the reconciler."""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any, cast

from libs.common.events import SetGpuHealth
from libs.common.gc_tuning import long_lived_gc
from libs.common.gpu import GpuEntry
from libs.common.metrics_http import serve_metrics
from libs.common.service import Runtime
from libs.common.wire import FrameServer, serve_frames
from services.gpu_manager.backends import Backend, HostBackend, cuda_available
from services.gpu_manager.commands import Commands
from services.gpu_manager.db import LeaseDb
from services.gpu_manager.gangs import GangBook
from services.gpu_manager.gpu_board import GpuBoard, host_board
from services.gpu_manager.gpu_publisher import GpuPublisher
from services.gpu_manager.keeper_client import KeeperClient
from services.gpu_manager.limits import ConnectionCount
from services.gpu_manager.manager import LeaseBook
from services.gpu_manager.metrics import gpu_manager_registry
from services.gpu_manager.mirror import Mirror
from services.gpu_manager.restore import WeightCopies
from services.gpu_manager.session import MAX_FDS_IN, fd_usage, serve_connection
from services.gpu_manager.settings import GpuManagerSettings
from services.gpu_manager.sleep import Sleeper
from services.gpu_manager.tier import HostTier

log = logging.getLogger("holdfast.gpu_manager")

FD_PRESSURE = 0.9  # health says degraded while this share of RLIMIT_NOFILE is open


def raise_fd_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard one: every chunk of every lease is one fd here (and one in the keeper,
    which inherits the limit), and a distribution's default soft limit (1024) is a few engines' worth."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def make_backend(kind: str, gpus: list[str], host_capacity_bytes: int | None = None,
                 host_capacity_fraction: float = 0.8) -> Backend:
    if kind == "auto":
        kind = "cuda" if cuda_available() else "host"
    if kind == "host":
        return HostBackend(host_capacity_bytes, host_capacity_fraction)
    if kind == "cuda":
        from services.gpu_manager.cuda_backend import CudaBackend  # needs cuda-python: only where asked for

        return CudaBackend(gpus)
    raise ValueError(f"unknown backend {kind!r} (host, cuda or auto)")



def health(backend: str, path: str, server: FrameServer, book: LeaseBook, conns: ConnectionCount,
           tier: HostTier) -> dict[str, Any]:
    """Health detail: `status` is `degraded` (with `degraded`: condition -> reason) while accepting fails or
    fds run short, `ok` otherwise; it recovers by itself once the condition ends."""
    open_fds, limit = fd_usage()
    degraded = {}
    if server.accept_trouble is not None:
        degraded["accept"] = f"cannot accept engine connections: {server.accept_trouble}"
    if open_fds >= FD_PRESSURE * limit:
        degraded["fds"] = f"{open_fds} of {limit} fds open"
    return {"status": "degraded" if degraded else "ok", "degraded": degraded, "backend": backend, "socket": path,
            "leases": len(book.records), "rejected_frames": book.rejected, "fds": {"open": open_fds, "limit": limit},
            "connections": sum(conns.by_uid.values()), "refused_connections": conns.refused, "host_tier": tier.health()}


def gpu_board(settings: GpuManagerSettings, backend: Backend) -> GpuBoard:
    """The GPUs this manager serves: the cuda backend's devices, or the host backend's simulated ones."""
    if backend.name == "host":
        return host_board(settings.node, settings.gpus, backend.capacity(0), settings.gpu_links)
    ordinals = getattr(backend, "ordinals", [])
    links = backend.nvlinks() if hasattr(backend, "nvlinks") else {}
    return GpuBoard(settings.node, [GpuEntry(o, backend.gpu_uuid(o) or f"GPU-{settings.node}-{o}", backend.capacity(o))
                                    for o in ordinals], links=links)


async def setup(rt: Runtime) -> None:
    settings = cast(GpuManagerSettings, rt.settings)
    settings.ensure_state_dir()
    fd_limit = raise_fd_limit()  # before the keeper starts: it inherits it
    backend = await asyncio.to_thread(make_backend, settings.backend, settings.gpus, settings.host_capacity_bytes,
                                      settings.host_capacity_fraction)
    db = LeaseDb(settings.database_url())
    keeper = KeeperClient(settings.keeper_path())
    mirror = Mirror(rt.bus, rt.store, settings.node)
    book = LeaseBook(settings, backend, db, keeper, mirror)
    book.board = gpu_board(settings, backend)
    rt.spawn("mirror", mirror.run())
    await book.load()
    tier = HostTier(settings.host_tier_bytes, keeper)
    tier.adopt(book.kept_tier)
    copies = WeightCopies(book, tier)
    await asyncio.to_thread(copies.sweep_scratch)

    def owner_exit(pid: int) -> None:
        task = asyncio.get_running_loop().create_task(book.owner_exited(pid), name=f"owner-exit:{pid}")
        pending.add(task)
        task.add_done_callback(pending.discard)

    pending: set[asyncio.Task[None]] = set()
    book.on_owner_exit = owner_exit

    gpus = GpuPublisher(book, rt.bus, rt.store, settings.gpu_publish_interval_s, copies=copies.listing)
    await gpus.restore()  # failed GPUs stay failed: before any command or engine can reach a lease there
    sleeper = Sleeper(book, copies)
    gangs = GangBook(book)  # tensor-parallel engines' leases, moved together
    await Commands(book, copies, sleeper, gangs).register(rt.bus, settings.node)
    await rt.bus.serve(settings.node, SetGpuHealth, gpus.set_health)
    rt.spawn("gpus", gpus.run())
    # The command subscriptions are at the server before any engine can reconnect (`serve` settles each one):
    # whoever saw an engine back (a test, the control plane) finds the commands answered, not "no responders".
    path = str(settings.socket_path())
    conns = ConnectionCount(settings.max_connections_per_uid, settings.max_connections_per_pid)
    server = await serve_frames(path, lambda stream: serve_connection(book, conns, stream, copies, sleeper, gangs=gangs),
                                mode=settings.socket_mode, group=settings.socket_group,
                                max_size=settings.max_frame_bytes, max_fds=MAX_FDS_IN)
    rt.spawn("reconciler", book.reconcile_forever())
    metrics_port = serve_metrics(rt, gpu_manager_registry(book, conns, server, fd_usage), settings.metrics_host,
                                 settings.metrics_port)
    rt.health_detail = lambda: {**health(backend.name, path, server, book, conns, tier), "metrics_port": metrics_port}

    async def close() -> None:
        await server.close()
        await copies.close()
        await book.close()
        keeper.close()
        db.close()

    rt.on_close(close)
    # The startup heap lives as long as the process: out of the collector's sight, a full collection does
    # not walk it in the middle of an engine's attach or takeover.
    long_lived_gc()
    log.info("gpu_manager on %s: backend %s, socket %s, %d live leases, fd limit %d", settings.node, backend.name,
             path, len(book.records), fd_limit[0])
