"""Length-prefixed msgpack frames over a unix stream socket, with file descriptors in SCM_RIGHTS.

One frame on the wire:

    header  = struct "!II": payload length, fd count
    payload = msgpack map (a dict with string keys)
    markers = one byte b"\\x00" per extra fd batch

SCM_RIGHTS carries at most 253 fds in one message (SCM_MAX_FD), so the fds travel in batches: the first batch
rides on the header+payload, each further batch on its own one-byte marker (ancillary data needs at least one
data byte). The receiver knows from the header how many bytes and fds to expect, reads exactly that many bytes
(never into the next frame) and collects fds from every recvmsg along the way.

Invariants:
1. A received frame has exactly the fd count its header declares, or the call raises and the fds that did
   arrive are closed (no fd leaks on any error path).
2. A frame larger than `max_size` is refused from its header, before its payload is read.
3. End of stream at a frame boundary is `PeerClosed`; inside a frame it is `TruncatedFrame`.
4. After `MalformedMessage` the stream's framing can no longer be trusted: callers reply and close.
5. A server's accept loop ends only with the server: a failed accept (EMFILE, ENFILE, ENOBUFS, ENOMEM, ...) is
   retried with backoff and logged once per episode, and `FrameServer.accept_trouble` says why meanwhile.

Two variants: blocking (`send_frame`/`recv_frame`, for the engine SDK, which has no event loop) and asyncio
(`FrameStream`, `serve_frames`, for services). Generic: nothing here knows about leases.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import grp
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import msgpack

from libs.common.errors import MalformedMessage

HEADER = struct.Struct("!II")
log = logging.getLogger("holdfast.wire")

MAX_FDS_PER_MESSAGE = 253  # SCM_MAX_FD in the Linux kernel
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
DEFAULT_MAX_FDS = 16384
_MARKER = b"\x00"
# accept() fails while the process (EMFILE) or the system (ENFILE) has no fd left, or the kernel no memory
# (ENOBUFS, ENOMEM): the connection stays queued in the backlog, so the server pauses and tries again.
ACCEPT_PAUSE_S = (0.01, 1.0)  # first and longest pause between accept attempts that failed
ACCEPT_QUIET_S = 2 * ACCEPT_PAUSE_S[1]  # no failure for this long ends an episode (longer than any pause)
_CMSG_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)


class FrameTooLarge(MalformedMessage):
    code = "frame_too_large"


class TruncatedFrame(MalformedMessage):
    code = "truncated"


class WrongFdCount(MalformedMessage):
    code = "wrong_fd_count"


class PeerClosed(ConnectionError):
    """The peer closed the connection cleanly, between frames."""


class PeerCredentials(NamedTuple):
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The pid, uid and gid of the process that connected (or accepted), from the kernel (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid, uid, gid)


# ---------------------------------------------------------------- encoding (pure)


def encode_frame(obj: dict[str, Any], fds: Sequence[int] = (), *, max_size: int = DEFAULT_MAX_FRAME
                 ) -> list[tuple[bytes, list[int]]]:
    """The (data, fds) segments to send in order, one sendmsg each (at most 253 fds a segment)."""
    if not isinstance(obj, dict):
        raise MalformedMessage(f"a frame is a dict, not {type(obj).__name__}")
    payload = encode_payload(obj)
    if len(payload) > max_size:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the limit of {max_size}")
    fds = list(fds)
    batches = [fds[i:i + MAX_FDS_PER_MESSAGE] for i in range(0, len(fds), MAX_FDS_PER_MESSAGE)] or [[]]
    segments = [(HEADER.pack(len(payload), len(fds)) + payload, batches[0])]
    segments.extend((_MARKER, batch) for batch in batches[1:])
    return segments


def encode_payload(obj: dict[str, Any]) -> bytes:
    """A frame's payload as sent (its size is the frame's, less the header and fd markers)."""
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def _marker_count(nfds: int) -> int:
    return max(0, (nfds + MAX_FDS_PER_MESSAGE - 1) // MAX_FDS_PER_MESSAGE - 1)


class _Assembler:
    """Accumulates one frame from recvmsg results; says how many bytes it still needs."""

    def __init__(self, max_size: int, max_fds: int) -> None:
        self.max_size = max_size
        self.max_fds = max_fds
        self.buf = bytearray()
        self.fds: list[int] = []
        self.total: int | None = None  # bytes of the whole frame once the header is known
        self.nfds = 0
        self.ctrunc = False

    def need(self) -> int:
        if self.total is None:
            return HEADER.size - len(self.buf)
        return self.total - len(self.buf)

    def feed(self, data: bytes, ancdata: list[tuple[int, int, bytes]], flags: int) -> None:
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(cdata[: len(cdata) - (len(cdata) % arr.itemsize)])
                self.fds.extend(arr)
        if len(self.fds) > self.max_fds:  # before the header says how many: not held until the frame ends
            raise WrongFdCount(f"{len(self.fds)} fds sent with a frame, more than the limit of {self.max_fds}")
        if flags & getattr(socket, "MSG_CTRUNC", 0):
            self.ctrunc = True  # the peer sent more fds in one message than the protocol allows
        self.buf += data
        if self.total is None and len(self.buf) >= HEADER.size:
            length, nfds = HEADER.unpack_from(self.buf)
            if length > self.max_size:
                raise FrameTooLarge(f"frame of {length} bytes exceeds the limit of {self.max_size}")
            if nfds > self.max_fds:
                raise WrongFdCount(f"frame declares {nfds} fds, more than the limit of {self.max_fds}")
            self.nfds = nfds
            self.total = HEADER.size + length + _marker_count(nfds)

    def finish(self) -> tuple[dict[str, Any], list[int]]:
        if self.ctrunc:
            raise WrongFdCount("fds were truncated: more than 253 in one message")
        if len(self.fds) != self.nfds:
            raise WrongFdCount(f"frame declares {self.nfds} fds but carried {len(self.fds)}")
        assert self.total is not None
        length = self.total - HEADER.size - _marker_count(self.nfds)
        payload = bytes(self.buf[HEADER.size:HEADER.size + length])
        if any(self.buf[HEADER.size + length:]):
            raise MalformedMessage("bad fd batch marker")
        obj = decode_payload(payload)
        fds, self.fds = self.fds, []
        return obj, fds

    def close_fds(self) -> None:
        close_fds(self.fds)
        self.fds = []


# Entries a decoded map or list may have: more than any request or reply holds (a lease set's tensors, an engine's
# leases), far fewer than a frame of tiny entries can carry: a 9 MB frame of a million keys took ~0.6 s to decode.
MAX_DECODED_ITEMS = 1 << 17


def decode_payload(payload: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_map_len=MAX_DECODED_ITEMS,
                              max_array_len=MAX_DECODED_ITEMS)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MalformedMessage(f"undecodable frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise MalformedMessage(f"a frame is a map, got {type(obj).__name__}")
    return obj


def close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _end_of_stream(asm: _Assembler) -> Exception:
    if not asm.buf:
        return PeerClosed("peer closed the connection")
    return TruncatedFrame(f"connection closed after {len(asm.buf)} bytes of a frame")


# ---------------------------------------------------------------- blocking variant


def send_frame(sock: socket.socket, obj: dict[str, Any], fds: Sequence[int] = (), *,
               max_size: int = DEFAULT_MAX_FRAME) -> None:
    """Send one frame; `fds` are duplicated into the peer (the caller keeps and still owns its own)."""
    for data, batch in encode_frame(obj, fds, max_size=max_size):
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", batch).tobytes())] if batch else []
        sent = sock.sendmsg([data], anc)
        if sent < len(data):
            sock.sendall(data[sent:])  # fds went with the first byte; the rest is plain data


def recv_frame(sock: socket.socket, *, max_size: int = DEFAULT_MAX_FRAME,
               max_fds: int = DEFAULT_MAX_FDS) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame: (message, fds). The caller owns the returned fds and must close them."""
    asm = _Assembler(max_size, max_fds)
    try:
        while (n := asm.need()) > 0:
            data, ancdata, flags, _ = sock.recvmsg(n, _CMSG_SPACE)
            if not data and not ancdata:
                raise _end_of_stream(asm)
            asm.feed(data, ancdata, flags)
        return asm.finish()
    except BaseException:
        asm.close_fds()
        raise


# ---------------------------------------------------------------- asyncio variant


class FrameStream:
    """Frames over a connected unix stream socket, on the running event loop.

    One reader at a time (recv is not meant to be called concurrently); sends are serialized by a lock so
    concurrent senders never interleave their frames.
    """

    def __init__(self, sock: socket.socket, *, max_size: int = DEFAULT_MAX_FRAME,
                 max_fds: int = DEFAULT_MAX_FDS) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.max_size = max_size
        self.max_fds = max_fds
        self._send_lock = asyncio.Lock()
        self._closed = False

    @classmethod
    async def connect(cls, path: str, **kwargs: Any) -> FrameStream:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            with unix_address(path) as address:
                await asyncio.get_running_loop().sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return cls(sock, **kwargs)

    def peer_credentials(self) -> PeerCredentials:
        return peer_credentials(self.sock)

    @property
    def closed(self) -> bool:
        return self._closed

    async def wait_readable(self) -> None:
        """Until a byte (or the end of the stream) can be read; reads nothing. A server bounds the idle time
        before a frame and the time of the frame itself separately with it."""
        loop = asyncio.get_running_loop()
        await self._wait(loop.add_reader, loop.remove_reader)

    async def _wait(self, register: Callable[..., None], unregister: Callable[[int], Any]) -> None:
        fut = asyncio.get_running_loop().create_future()
        fileno = self.sock.fileno()
        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        register(fileno, wake)
        try:
            await fut
        finally:
            unregister(fileno)

    async def send(self, obj: dict[str, Any], fds: Sequence[int] = ()) -> None:
        segments = encode_frame(obj, fds, max_size=self.max_size)
        loop = asyncio.get_running_loop()
        async with self._send_lock:
            for data, batch in segments:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", batch).tobytes())] if batch else []
                view = memoryview(data)
                while view:
                    try:
                        sent = self.sock.sendmsg([view], anc)
                    except (BlockingIOError, InterruptedError):
                        await self._wait(loop.add_writer, loop.remove_writer)
                        continue
                    view, anc = view[sent:], []  # ancillary data went with the first byte sent

    async def recv(self) -> tuple[dict[str, Any], list[int]]:
        loop = asyncio.get_running_loop()
        asm = _Assembler(self.max_size, self.max_fds)
        try:
            while (n := asm.need()) > 0:
                try:
                    data, ancdata, flags, _ = self.sock.recvmsg(n, _CMSG_SPACE)
                except (BlockingIOError, InterruptedError):
                    await self._wait(loop.add_reader, loop.remove_reader)
                    continue
                if not data and not ancdata:
                    raise _end_of_stream(asm)
                asm.feed(data, ancdata, flags)
            return asm.finish()
        except BaseException:
            asm.close_fds()
            raise

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close()


class AcceptEpisodes:
    """Failed accepts counted in episodes, for an accept loop that retries them (FrameServer's own, or asyncio's:
    accept_trouble.py): one warning when an episode starts, one line at the first accept after a quiet
    `ACCEPT_QUIET_S` where the loop says it accepted (near the limit, accepts fail and succeed in turn: that is one
    episode; one that ended with no accept since, its clients gone, is over too), and `trouble` meanwhile."""

    def __init__(self, name: str, retrying: str) -> None:
        self.name, self.retrying = name, retrying  # what fails, and how its loop tries again (said once an episode)
        self.failures = 0  # in the episode under way
        self.total = 0
        self._since: float | None = None  # start of the episode under way
        self._last = 0.0
        self._error = ""

    def failed(self, e: OSError) -> None:
        now = time.monotonic()
        if self._since is None or now - self._last >= ACCEPT_QUIET_S:
            self._since, self.failures = now, 0
            log.warning("%s: cannot accept connections (%s); %s", self.name, _errno_text(e), self.retrying)
        self.failures += 1
        self.total += 1
        self._last, self._error = now, _errno_text(e)

    def accepted(self) -> None:
        if self._since is not None and time.monotonic() - self._last >= ACCEPT_QUIET_S:
            log.warning("%s: accepting again after %d failed accepts over %.1f s", self.name, self.failures,
                        self._last - self._since)
            self._since, self.failures = None, 0

    @property
    def trouble(self) -> str | None:
        """Why accepting fails now, or None once no accept has failed for `ACCEPT_QUIET_S`."""
        if self._since is None or time.monotonic() - self._last >= ACCEPT_QUIET_S:
            return None
        return f"{self._error}: {self.failures} failed accepts in {time.monotonic() - self._since:.1f} s"


class FrameServer:
    """A listening unix socket that runs `handler(stream)` per connection, each in its own task."""

    def __init__(self, sock: socket.socket, path: str,
                 handler: Callable[[FrameStream], Awaitable[None]], stream_kwargs: dict[str, Any]) -> None:
        self.sock = sock
        self.path = path
        self._handler = handler
        self._stream_kwargs = stream_kwargs
        self._tasks: set[asyncio.Task[None]] = set()
        self._accept_task: asyncio.Task[None] | None = None
        self.episodes = AcceptEpisodes(path, "retrying with backoff, connections wait in the backlog")

    def start(self) -> None:
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(), name=f"accept:{self.path}")

    async def _accept_loop(self) -> None:
        """Accept forever. A failed accept (no fd left, no kernel memory, a connection aborted in the queue)
        pauses, doubling up to a second, and tries again: it never ends the loop. One warning when an episode
        of failures starts, one line at the first accept after a quiet `ACCEPT_QUIET_S` (near the limit,
        accepts fail and succeed in turn: that is one episode); `accept_trouble` says what is wrong meanwhile."""
        loop = asyncio.get_running_loop()
        pause = ACCEPT_PAUSE_S[0]
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as e:
                if e.errno == errno.EBADF:  # our own socket closed under us: close() is under way
                    return
                self.episodes.failed(e)
                await asyncio.sleep(pause)
                pause = min(pause * 2, ACCEPT_PAUSE_S[1])
                continue
            pause = ACCEPT_PAUSE_S[0]
            self.episodes.accepted()
            stream = FrameStream(conn, **self._stream_kwargs)
            task = loop.create_task(self._run(stream), name=f"conn:{self.path}:{conn.fileno()}")
            self._tasks.add(task)  # keep a reference so the task is not collected mid-flight
            task.add_done_callback(self._tasks.discard)

    @property
    def accept_trouble(self) -> str | None:
        return self.episodes.trouble

    async def _run(self, stream: FrameStream) -> None:
        try:
            await self._handler(stream)
        finally:
            stream.close()

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
        self.sock.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def __aenter__(self) -> FrameServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _errno_text(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, "")
    return f"{name} ({e.strerror})" if name else repr(e)


SUN_PATH_MAX = 107  # bytes of a unix socket's path the kernel takes (sun_path, NUL-terminated)


@contextlib.contextmanager
def unix_address(path: str) -> Iterator[str]:
    """An address for bind/connect of the unix socket at `path`. A path longer than the kernel takes (a state
    directory deep in a home or a CI workspace: `OSError: AF_UNIX path too long`) is reached through its directory,
    held open for the call: `/proc/self/fd/<fd>/<name>` (Linux). The socket's file is the same either way."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        yield path
        return
    parent, name = os.path.split(os.path.abspath(path))
    fd = os.open(parent, os.O_PATH | os.O_DIRECTORY)
    try:
        short = f"/proc/self/fd/{fd}/{name}"
        if len(os.fsencode(short)) > SUN_PATH_MAX:
            raise OSError(errno.ENAMETOOLONG, f"the socket's name {name!r} is too long for a unix socket")
        yield short
    finally:
        os.close(fd)


def listen_unix(path: str, *, mode: int = 0o600, group: str | int | None = None, backlog: int = 128
                ) -> socket.socket:
    """Bind a listening unix socket at `path` (replacing a stale one), with `mode` and optional group."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # umask so the socket never exists with wider permissions, even for an instant
        old = os.umask(0o777 & ~mode)
        try:
            with unix_address(path) as address:
                sock.bind(address)
        finally:
            os.umask(old)
        os.chmod(path, mode)
        if group is not None:
            gid = group if isinstance(group, int) else grp.getgrnam(group).gr_gid
            os.chown(path, -1, gid)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_frames(path: str, handler: Callable[[FrameStream], Awaitable[None]], *, mode: int = 0o600,
                       group: str | int | None = None, max_size: int = DEFAULT_MAX_FRAME,
                       max_fds: int = DEFAULT_MAX_FDS) -> FrameServer:
    """Listen on `path` and serve each connection with `handler`; the stream is closed when it returns."""
    server = FrameServer(listen_unix(path, mode=mode, group=group), path, handler,
                         {"max_size": max_size, "max_fds": max_fds})
    server.start()
    return server
