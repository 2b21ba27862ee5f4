"""The fd keeper: a tiny process that holds a duplicate of every exported fd, so leased memory outlives a
crash or upgrade of the gpu_manager itself (measured on an H200: a process with no CUDA context holding the
exported fds keeps the memory alive).

It imports no CUDA and no torch. It serves frames (libs.common.wire) on its own unix socket, only to peers of
its own uid:
    {"op": "put", "key": k, "meta": {...}} + fds   store (replacing and closing an older entry of that key)
    {"op": "drop", "key": k}                         close the entry's fds
    {"op": "list"}                                   every entry, and all their fds in entry order
    {"op": "ping"}                                   {"pid": ...}
One keeper per socket path: it holds an flock on `<socket>.lock` for its whole life.

Run: python -m services.gpu_manager.keeper <socket path>
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from libs.common.errors import HoldfastError, MalformedMessage, PermissionDenied
from libs.common.wire import FrameStream, PeerClosed, close_fds, serve_frames

log = logging.getLogger("holdfast.keeper")


class FdKeeper:
    def __init__(self) -> None:
        self.entries: dict[str, tuple[dict[str, Any], list[int]]] = {}

    def put(self, key: str, meta: dict[str, Any], fds: list[int]) -> None:
        old = self.entries.pop(key, None)
        if old is not None:
            close_fds(old[1])
        self.entries[key] = (meta, fds)

    def drop(self, key: str) -> bool:
        old = self.entries.pop(key, None)
        if old is not None:
            close_fds(old[1])
        return old is not None

    def listing(self) -> tuple[list[dict[str, Any]], list[int]]:
        entries, fds = [], []
        for key, (meta, efds) in self.entries.items():
            entries.append({"key": key, "n": len(efds), "meta": meta})
            fds.extend(efds)
        return entries, fds

    async def handle(self, stream: FrameStream) -> None:
        if stream.peer_credentials().uid != os.getuid():
            await stream.send({"ok": False, "error": PermissionDenied("not the keeper's uid").to_dict()})
            return
        while True:
            try:
                req, fds = await stream.recv()
            except PeerClosed:
                return
            except MalformedMessage as e:
                await stream.send({"ok": False, "error": e.to_dict()})
                return
            try:
                reply, out_fds = self.apply(req, fds)
            except HoldfastError as e:
                close_fds(fds)
                reply, out_fds = {"ok": False, "error": e.to_dict()}, []
            await stream.send(reply, out_fds)

    def apply(self, req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        op = req.get("op")
        if op == "put" and isinstance(req.get("key"), str):
            self.put(req["key"], dict(req.get("meta") or {}), fds)
            return {"ok": True}, []
        if fds:
            raise MalformedMessage(f"'{op}' carries no fds")
        if op == "drop" and isinstance(req.get("key"), str):
            return {"ok": True, "dropped": self.drop(req["key"])}, []
        if op == "list":
            entries, out = self.listing()
            return {"ok": True, "entries": entries}, out
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "entries": len(self.entries)}, []
        raise MalformedMessage(f"unknown keeper request {op!r}")


async def serve(path: str) -> None:
    keeper = FdKeeper()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await serve_frames(path, keeper.handle, mode=0o600)
    Path(path + ".pid").write_text(str(os.getpid()))  # noqa: ASYNC240 - once, at start, a few bytes
    log.info("fd keeper %d serving %s", os.getpid(), path)
    try:
        await stop.wait()
    finally:
        await server.close()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s keeper %(levelname)s %(message)s")
    path = argv[0]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lock = open(path + ".lock", "w")  # noqa: SIM115 - held for the life of the process
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("another keeper holds %s; exiting", path)
        return
    asyncio.run(serve(path))


if __name__ == "__main__":
    main(sys.argv[1:])
