"""A death mark's owner for the tests: a real process that makes its mark on its main thread and sends its fd."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The owner: makes its mark on its main thread, holds 256 MiB (a teardown long after the mark's release, as a CUDA
# engine's), sends the mark's fd, then unlocks the mark when told to ("u") or sleeps until it is killed.
OWNER = """
import ctypes, os, socket, sys, time
from libs.common.death_mark import DeathMark
sock = socket.socket(fileno=int(sys.argv[1]))
mark = DeathMark.create()
ballast = bytearray(256 << 20)
ballast[::4096] = b"\\1" * len(range(0, len(ballast), 4096))
socket.send_fds(sock, [b"m"], [mark.fd])
if sock.recv(1) == b"u":
    libc = ctypes.CDLL("libc.so.6")
    libc.pthread_mutex_unlock((ctypes.c_char * 64).from_buffer(mark._mm))
    sock.send(b"k")
time.sleep(60)
"""


@contextmanager
def owner() -> Iterator[tuple[subprocess.Popen[bytes], socket.socket, int]]:
    """The owner process, our end of its socket and the mark's fd it sent (ours to close)."""
    ours, theirs = socket.socketpair()
    p = subprocess.Popen([sys.executable, "-c", OWNER, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    theirs.close()
    try:
        ours.settimeout(60)
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        yield p, ours, fds[0]
    finally:
        p.kill()
        p.wait(10)
        ours.close()
