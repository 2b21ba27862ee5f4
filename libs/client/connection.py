"""The SDK's socket to the gpu_manager: opening it (connect + hello), one request/reply round trip, and the
backoff between reconnection attempts. Blocking; no locking here (MemoryClient serializes)."""

from __future__ import annotations

import random
import socket
from typing import Any

from libs.client import protocol as p
from libs.common.wire import TruncatedFrame, close_fds, recv_frame, send_frame

# A connection is broken when the socket fails or the manager's side ends (even mid-frame): the manager was
# killed or restarted. Anything else (an error reply) is the manager speaking and is not a broken connection.
BROKEN = (OSError, TruncatedFrame)


def open_session(path: str, engine_id: str, engine_class: str) -> tuple[socket.socket, dict[str, Any]]:
    """Connect and say hello; returns the socket and the raw hello reply (the caller checks it)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        send_frame(sock, p.Hello(engine_id=engine_id, engine_class=engine_class).model_dump(mode="json"))
        reply, fds = recv_frame(sock)
        close_fds(fds)
    except BaseException:
        sock.close()
        raise
    return sock, reply


def round_trip(sock: socket.socket, req: p.Msg) -> tuple[dict[str, Any], list[int]]:
    send_frame(sock, req.model_dump(mode="json"))
    return recv_frame(sock)


class Backoff:
    """Exponential delays with jitter, from `first` up to `cap` seconds: the manager may be down a while
    (a restart reloads its table), and many engines of a node should not knock all at once."""

    def __init__(self, first: float = 0.05, cap: float = 2.0) -> None:
        self.first, self.cap = first, cap
        self._next = first

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._next = self.first
