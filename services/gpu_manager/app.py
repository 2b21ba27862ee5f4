"""Wiring: backend, lease table, keeper, mirror, the engine socket, NATS commands and the reconciler."""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from libs.common.gc_tuning import long_lived_gc
from libs.common.service import Runtime
from libs.common.wire import serve_frames
from services.gpu_manager.backends import make_backend
from services.gpu_manager.commands import Commands
from services.gpu_manager.db import LeaseDb
from services.gpu_manager.keeper_client import KeeperClient
from services.gpu_manager.manager import LeaseBook
from services.gpu_manager.mirror import Mirror
from services.gpu_manager.session import serve_connection
from services.gpu_manager.settings import GpuManagerSettings

log = logging.getLogger("holdfast.gpu_manager")


async def setup(rt: Runtime) -> None:
    settings = cast(GpuManagerSettings, rt.settings)
    settings.ensure_state_dir()
    backend = await asyncio.to_thread(make_backend, settings.backend, settings.gpus)
    db = LeaseDb(settings.database_url())
    keeper = KeeperClient(settings.keeper_path())
    mirror = Mirror(rt.bus, rt.store, settings.node)
    book = LeaseBook(settings, backend, db, keeper, mirror)
    rt.spawn("mirror", mirror.run())
    await book.load()

    def owner_exit(pid: int) -> None:
        task = asyncio.get_running_loop().create_task(book.owner_exited(pid), name=f"owner-exit:{pid}")
        pending.add(task)
        task.add_done_callback(pending.discard)

    pending: set[asyncio.Task[None]] = set()
    book.on_owner_exit = owner_exit

    await Commands(book).register(rt.bus, settings.node)
    # The command subscriptions are at the server (a round trip) before any engine can reconnect: whoever saw
    # an engine back (a test, the control plane) finds the commands answered, not "no responders".
    await rt.bus.nc.flush()
    path = str(settings.socket_path())
    server = await serve_frames(path, lambda stream: serve_connection(book, stream), mode=settings.socket_mode,
                                group=settings.socket_group, max_size=settings.max_frame_bytes)
    rt.spawn("reconciler", book.reconcile_forever())
    rt.health_detail = lambda: {"backend": backend.name, "socket": path, "leases": len(book.records),
                                "rejected_frames": book.rejected}

    async def close() -> None:
        await server.close()
        await book.close()
        keeper.close()
        db.close()

    rt.on_close(close)
    # The startup heap lives as long as the process: out of the collector's sight, a full collection does
    # not walk it in the middle of an engine's attach or takeover.
    long_lived_gc()
    log.info("gpu_manager on %s: backend %s, socket %s, %d live leases", settings.node, backend.name, path,
             len(book.records))
