"""The fd keeper: a tiny process that holds a duplicate of every exported fd, so leased memory outlives a
crash or upgrade of the gpu_manager itself (measured on an H200: a process with no CUDA context holding the
exported fds keeps the memory alive).

It imports no CUDA and no torch. It serves frames (libs.common.wire) on its own unix socket (0600), only to the
gpu_manager: the process of its uid that holds the flock on `<socket>.manager` (keeper_client.py takes it for the
manager's whole life; the kernel lets it go with the process, so a restarted manager takes it again). Any other
process of that uid (every engine runs as it) was served too: it listed every lease's memfds and read another
engine's memory, put its own fds over a live lease (a successor then attached the intruder's bytes after a
manager restart) or dropped a lease's copies (probe of 2026-12-06). Requests:
    {"op": "put", "key": k, "meta": {...}} + fds   store (replacing and closing an older entry of that key)
    {"op": "drop", "key": k}                         close the entry's fds
    {"op": "list"}                                   every entry, and all their fds in entry order
    {"op": "ping"}                                   {"pid": ...}
One keeper per socket path: it holds an flock on `<socket>.lock` for its whole life. Whatever a request is, the fds
that came with it are this process's to close unless an entry keeps them.

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


MANAGER_LOCK = ".manager"  # `<socket>` + this: the flock the gpu_manager holds while it runs


def lock_holder(path: str) -> int | None:
    """The pid that holds an flock on `path` (/proc/locks, this pid namespace's pids), or None."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5309756 0 EOF"; a waiter's has "->" after "1:"
        parts = line.split()
        if len(parts) == 8 and parts[1] == "FLOCK" and parts[5] == want and parts[4].isdigit():
            return int(parts[4])
    return None


class FdKeeper:
    def __init__(self, manager_lock: str) -> None:
        self.entries: dict[str, tuple[dict[str, Any], list[int]]] = {}
        self.manager_lock = manager_lock

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
        peer = stream.peer_credentials()
        if peer.uid != os.getuid() or peer.pid != lock_holder(self.manager_lock):
            log.warning("refused pid %d (uid %d): not the gpu_manager holding %s", peer.pid, peer.uid,
                        self.manager_lock)
            await stream.send({"ok": False, "error": PermissionDenied(
                f"only the gpu_manager (the holder of {self.manager_lock}) may use the fd keeper").to_dict()})
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
            except Exception as e:  # noqa: BLE001 - whatever failed, the fds it brought are closed and it is told
                close_fds(fds)
                err = e if isinstance(e, HoldfastError) else MalformedMessage(f"keeper request refused: {e!r}")
                reply, out_fds = {"ok": False, "error": err.to_dict()}, []
            await stream.send(reply, out_fds)

    def apply(self, req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        op = req.get("op")
        if op == "put" and isinstance(req.get("key"), str):
            meta = req.get("meta") or {}
            if not isinstance(meta, dict):
                raise MalformedMessage(f"a put's meta is an object, not {type(meta).__name__}")
            self.put(req["key"], meta, fds)
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
    keeper = FdKeeper(path + MANAGER_LOCK)
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
    os.umask(0o077)  # its pid and lock files, as its gpu_manager's (services/gpu_manager/__main__.py)
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
