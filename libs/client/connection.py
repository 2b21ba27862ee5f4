"""The SDK's socket to the gpu_manager: opening it (connect + hello), one request/reply round trip, and the
backoff between reconnection attempts. Blocking; no locking here (MemoryClient serializes).

Every socket opened here carries a timeout (`timeout_s`; default `HF_GPU_MANAGER_TIMEOUT_S`, else
DEFAULT_TIMEOUT_S): a connect, a send and every recv of a frame give up with `TimeoutError` once the manager
has made no progress for that long (a manager stopped, wedged, or flooded cannot hang an engine)."""

from __future__ import annotations

import os
import socket
from typing import Any

from libs.client import protocol as p
from libs.common.wire import TruncatedFrame, close_fds, recv_frame, send_frame, unix_address

# A connection is broken when the socket fails or the manager's side ends (even mid-frame): the manager was
# killed or restarted. Anything else (an error reply) is the manager speaking and is not a broken connection.
BROKEN = (OSError, TruncatedFrame)
# Generous: the longest request is an allocate of a GPU's worth of chunks (cuMemCreate + export, one by one).
DEFAULT_TIMEOUT_S = 60.0


def timeout_s(explicit: float | None = None) -> float:
    """The SDK's socket timeout: the caller's, else HF_GPU_MANAGER_TIMEOUT_S, else DEFAULT_TIMEOUT_S."""
    if explicit is not None:
        return explicit
    raw = os.environ.get("HF_GPU_MANAGER_TIMEOUT_S")
    return float(raw) if raw else DEFAULT_TIMEOUT_S


def open_session(path: str, engine_id: str, engine_class: str, timeout: float) -> tuple[socket.socket, dict[str, Any]]:
    """Connect and say hello, each within `timeout` (kept on the socket for every later call); returns the socket
    and the raw hello reply (the caller checks it)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        with unix_address(path) as address:
            sock.connect(address)
        try:
            send_frame(sock, p.Hello(engine_id=engine_id, engine_class=engine_class).model_dump(mode="json"))
        except BrokenPipeError:
            pass  # refused at accept (a limit): the manager's typed reply is already here, read below
        reply, fds = recv_frame(sock)
        close_fds(fds)
    except BaseException:
        sock.close()
        raise
    return sock, reply


def round_trip(sock: socket.socket, req: p.Msg) -> tuple[dict[str, Any], list[int]]:
    send_frame(sock, req.model_dump(mode="json"))
    return recv_frame(sock)


def peer_gone(sock: socket.socket) -> bool:
    """Whether the manager closed this connection while nothing was asked (an idle close, a restart): then a
    request has not been sent at all and may go, even if not repeatable, on a new connection. One peek, which
    never waits (non-blocking for the call: with a timeout set, Python would first wait for readability)."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False  # open, nothing to read: the usual case
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)
