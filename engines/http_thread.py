"""uvicorn on a thread of its own (the reference and pattern engines' HTTP servers)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn


class HttpThread:
    """uvicorn serving `app` on a thread of its own (it installs no signal handlers off the main thread);
    `warm(endpoint)` runs once it listens, before anything is served (each engine's first-use costs)."""

    def __init__(self, app: Any, host: str, port: int, warm: Callable[[str], None]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"http://{host}:{self.port}"
        self._warm = warm
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http", daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start")
        self._warm(self.endpoint)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
