"""Frames with fds over unix sockets: round trips, fd batches, and every malformed input as a typed error."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
import threading

import msgpack
import pytest

from libs.common.errors import MalformedMessage
from libs.common.wire import (
    HEADER,
    FrameStream,
    FrameTooLarge,
    PeerClosed,
    TruncatedFrame,
    WrongFdCount,
    peer_credentials,
    recv_frame,
    send_frame,
    serve_frames,
    unix_address,
)


def _memfd_with(content: bytes) -> int:
    fd = os.memfd_create("wire-test")
    os.write(fd, content)
    return fd


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, 64, 0)


def _open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload), 0) + payload


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_a_frame_round_trips_with_its_fds(pair):
    a, b = pair
    fds = [_memfd_with(f"fd{i}".encode()) for i in range(3)]
    send_frame(a, {"op": "hello", "n": 3, "blob": b"\x00\x01"}, fds)
    obj, got = recv_frame(b)
    assert obj == {"op": "hello", "n": 3, "blob": b"\x00\x01"}
    assert [_read_fd(fd) for fd in got] == [b"fd0", b"fd1", b"fd2"]
    for fd in fds + got:
        os.close(fd)


def test_more_fds_than_one_message_carries_travel_in_batches(pair):
    a, b = pair
    fds = [_memfd_with(str(i).encode()) for i in range(600)]  # 3 batches: 253 + 253 + 94
    send_frame(a, {"op": "many"}, fds)
    send_frame(a, {"op": "next"})
    obj, got = recv_frame(b)
    assert obj == {"op": "many"}
    assert [int(_read_fd(fd)) for fd in got] == list(range(600))
    assert recv_frame(b) == ({"op": "next"}, [])  # the batch markers did not leak into the next frame
    for fd in fds + got:
        os.close(fd)


def test_consecutive_frames_are_not_glued(pair):
    a, b = pair
    mine = []
    for i in range(50):
        fds = [_memfd_with(b"x")] if i % 7 == 0 else []
        mine += fds
        send_frame(a, {"i": i}, fds)
    for i in range(50):
        obj, got = recv_frame(b)
        assert obj == {"i": i}
        assert len(got) == (1 if i % 7 == 0 else 0)
        for fd in got:
            os.close(fd)
    for fd in mine:
        os.close(fd)


def test_an_oversized_frame_is_refused_from_its_header(pair):
    a, b = pair
    a.sendall(HEADER.pack(1 << 30, 0))
    with pytest.raises(FrameTooLarge):
        recv_frame(b, max_size=1 << 20)


def test_a_sender_cannot_build_an_oversized_frame(pair):
    a, _ = pair
    with pytest.raises(FrameTooLarge):
        send_frame(a, {"blob": b"x" * 2048}, max_size=1024)


def test_a_truncated_frame_is_a_typed_error_and_its_fds_are_closed(pair):
    a, b = pair
    payload = msgpack.packb({"op": "x"})
    fd = _memfd_with(b"t")
    a.sendmsg([HEADER.pack(len(payload) + 10, 1) + payload],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
    a.shutdown(socket.SHUT_WR)
    before = _open_fd_count()
    with pytest.raises(TruncatedFrame):
        recv_frame(b)
    assert _open_fd_count() == before  # the received duplicate was closed
    os.close(fd)


def test_end_of_stream_between_frames_is_a_clean_close(pair):
    a, b = pair
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(PeerClosed):
        recv_frame(b)


def test_a_frame_with_fewer_fds_than_declared_is_refused(pair):
    a, b = pair
    payload = msgpack.packb({"op": "x"})
    a.sendall(HEADER.pack(len(payload), 1) + payload)
    with pytest.raises(WrongFdCount):
        recv_frame(b)


def test_a_frame_with_more_fds_than_declared_is_refused_and_they_are_closed(pair):
    a, b = pair
    payload = msgpack.packb({"op": "x"})
    fds = [_memfd_with(b"a"), _memfd_with(b"b")]
    a.sendmsg([HEADER.pack(len(payload), 0) + payload],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("2i", *fds))])
    before = _open_fd_count()
    with pytest.raises(WrongFdCount):
        recv_frame(b)
    assert _open_fd_count() == before
    for fd in fds:
        os.close(fd)


def test_fds_past_the_limit_before_the_header_is_whole_are_refused_and_closed(pair):
    """4 bytes of a header with 8 fds: refused at once (they were held until the frame's deadline), every one closed."""
    a, b = pair
    fds = [_memfd_with(b"x") for _ in range(8)]
    a.sendmsg([HEADER.pack(10, 1)[:4]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("8i", *fds))])
    before = _open_fd_count()
    with pytest.raises(WrongFdCount):
        recv_frame(b, max_fds=1)
    assert _open_fd_count() == before
    for fd in fds:
        os.close(fd)


def test_a_map_of_more_entries_than_any_frame_holds_is_refused_undecoded(pair):
    a, b = pair
    frame = _frame(msgpack.packb({"op": "x", "epochs": {str(i): 1 for i in range((1 << 17) + 1)}}))
    sender = threading.Thread(target=a.sendall, args=(frame,), daemon=True)  # more than the socket buffers
    sender.start()
    with pytest.raises(MalformedMessage):
        recv_frame(b, max_size=64 << 20)
    sender.join(10)


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({1: 2}), b"\x92\x01"])
def test_undecodable_or_non_map_payloads_are_malformed(pair, payload):
    a, b = pair
    a.sendall(HEADER.pack(len(payload), 0) + payload)
    with pytest.raises(MalformedMessage):
        recv_frame(b)


def test_peer_credentials_name_this_process(pair):
    a, _ = pair
    creds = peer_credentials(a)
    assert (creds.pid, creds.uid, creds.gid) == (os.getpid(), os.getuid(), os.getgid())


async def test_async_server_and_client_exchange_frames_and_fds(tmp_path):
    path = str(tmp_path / "s.sock")
    seen = []

    async def echo(stream: FrameStream) -> None:
        seen.append(stream.peer_credentials().pid)
        while True:
            try:
                obj, fds = await stream.recv()
            except PeerClosed:
                return
            await stream.send({"echo": obj, "nfds": len(fds)}, fds)
            for fd in fds:
                os.close(fd)

    server = await serve_frames(path, echo)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        client = await FrameStream.connect(path)
        fds = [_memfd_with(str(i).encode()) for i in range(300)]
        await client.send({"op": "ping"}, fds)
        obj, got = await client.recv()
        assert obj == {"echo": {"op": "ping"}, "nfds": 300}
        assert [int(_read_fd(fd)) for fd in got] == list(range(300))
        for fd in fds + got:
            os.close(fd)
        client.close()
        assert seen == [os.getpid()]
    finally:
        await server.close()
    assert path not in {str(p) for p in tmp_path.iterdir()}


async def test_a_large_frame_is_sent_through_a_full_socket_buffer(tmp_path):
    path = str(tmp_path / "big.sock")
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def slow_reader(stream: FrameStream) -> None:
        await asyncio.sleep(0.05)  # let the sender fill the socket buffer first
        got.set_result(await stream.recv())

    server = await serve_frames(path, slow_reader)
    try:
        client = await FrameStream.connect(path)
        blob = os.urandom(4 * 1024 * 1024)
        await client.send({"blob": blob})
        obj, fds = await got
        assert obj["blob"] == blob and fds == []
        client.close()
    finally:
        await server.close()


async def test_async_server_reports_a_malformed_frame_and_keeps_serving_others(tmp_path):
    path = str(tmp_path / "m.sock")
    errors: list[str] = []

    async def handler(stream: FrameStream) -> None:
        try:
            obj, _ = await stream.recv()
        except MalformedMessage as exc:
            errors.append(exc.code)
            return
        await stream.send({"ok": obj})

    server = await serve_frames(path, handler, max_size=1024)
    try:
        bad = socket.socket(socket.AF_UNIX)
        bad.connect(path)
        bad.sendall(HEADER.pack(10_000, 0))
        good = await FrameStream.connect(path)
        await good.send({"x": 1})
        assert (await good.recv()) == ({"ok": {"x": 1}}, [])
        good.close()
        bad.close()
        for _ in range(100):
            if errors:
                break
            await asyncio.sleep(0.01)
        assert errors == ["frame_too_large"]
    finally:
        await server.close()


async def test_a_socket_deeper_than_the_kernels_path_limit_is_served_and_reached(tmp_path):
    """A state directory whose socket path passes sun_path's 107 bytes (`OSError: AF_UNIX path too long` before) is
    bound and connected through its directory; the socket's file and mode are the same."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    path = str(deep / "agent.sock")
    assert len(os.fsencode(path)) > 107

    async def echo(stream: FrameStream) -> None:
        with contextlib.suppress(PeerClosed):
            obj, _ = await stream.recv()
            await stream.send({"echo": obj, "pid": stream.peer_credentials().pid})

    server = await serve_frames(path, echo)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        client = await FrameStream.connect(path)
        await client.send({"op": "ping"})
        assert (await client.recv())[0] == {"echo": {"op": "ping"}, "pid": os.getpid()}
        client.close()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, unix_address(path) as address:
            s.connect(address)  # the blocking clients' way (libs/client)
    finally:
        await server.close()
    with pytest.raises(OSError, match="too long"), unix_address(str(tmp_path / ("n" * 120))):
        pass
