"""The manager's side of the fd keeper: connect (starting a detached keeper if none runs), put, drop, list.

Before it connects, the manager takes the flock the keeper serves (`<socket>.manager`, keeper.py) and holds it
until it closes or exits: one gpu_manager per keeper, and the keeper serves that process alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from libs.common.errors import RemoteError, Unavailable
from libs.common.wire import FrameStream
from services.gpu_manager.keeper import MANAGER_LOCK

log = logging.getLogger("holdfast.gpu_manager.keeper")

START_TIMEOUT_S = 15.0


def start_keeper(path: Path) -> int:
    """Start a keeper in its own session (it must outlive this process) and return its pid."""
    log_path = path.with_suffix(".log")
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.gpu_manager.keeper", str(path)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=str(Path(__file__).resolve().parents[2]), close_fds=True,
        )
    return proc.pid


class KeeperClient:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.stream: FrameStream | None = None
        self._lock = asyncio.Lock()
        self._held: int | None = None  # the manager's flock (keeper.py `MANAGER_LOCK`), once taken

    def _hold(self) -> None:
        if self._held is not None:
            return
        fd = os.open(str(self.path) + MANAGER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Unavailable(f"another gpu_manager uses the fd keeper on {self.path} (it holds "
                              f"{self.path}{MANAGER_LOCK})") from None
        self._held = fd

    async def connect(self) -> None:
        """Connect to the running keeper, or start one and wait for it."""
        self._hold()
        try:
            self.stream = await FrameStream.connect(str(self.path))
            return
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        pid = start_keeper(self.path)
        log.info("started fd keeper pid %d on %s", pid, self.path)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self.stream = await FrameStream.connect(str(self.path))
                return
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.02)
        raise Unavailable(f"fd keeper did not come up on {self.path}")

    async def call(self, req: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> tuple[dict[str, Any], list[int]]:
        async with self._lock:
            if self.stream is None:
                await self.connect()
            assert self.stream is not None
            try:
                await self.stream.send(req, fds)
                reply, out = await self.stream.recv()
            except (ConnectionError, OSError) as e:
                self.stream.close()
                self.stream = None
                raise Unavailable(f"fd keeper connection lost: {e}") from None
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise RemoteError(str(err.get("code", "error")), str(err.get("message", "")))
        return reply, out

    async def put(self, key: str, fds: list[int], meta: dict[str, Any] | None = None) -> None:
        await self.call({"op": "put", "key": key, "meta": meta or {}}, fds)

    async def drop(self, key: str) -> None:
        await self.call({"op": "drop", "key": key})

    async def listing(self) -> dict[str, tuple[dict[str, Any], list[int]]]:
        reply, fds = await self.call({"op": "list"})
        out, i = {}, 0
        for entry in reply.get("entries", []):
            n = int(entry["n"])
            out[str(entry["key"])] = (dict(entry.get("meta") or {}), fds[i:i + n])
            i += n
        return out

    async def ping(self) -> int:
        reply, _ = await self.call({"op": "ping"})
        return int(reply["pid"])

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if self._held is not None:
            os.close(self._held)  # the flock goes with its last fd
            self._held = None


def keeper_pid(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(Path(str(path) + ".pid").read_text().strip())
    return None
