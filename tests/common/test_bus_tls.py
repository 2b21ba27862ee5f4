"""The bus's connection over TLS (the session's nats-server requires it): what TLS costs per message."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from nats.aio.msg import Msg

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from tests.support import OwnNats


async def tls_writes_for(bus: Bus, count: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many SSLObject writes (each at least one TLS record) `count` publishes and one flush take; checks that
    every message came back, in order."""
    writes = [0]
    real_write = ssl.SSLObject.write

    def counted(self: ssl.SSLObject, data: Any) -> int:
        writes[0] += 1
        return real_write(self, data)

    got: list[bytes] = []
    done = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        got.append(msg.data)
        if len(got) == count:
            done.set()

    subject = f"{bus.prefix}.tls-records"
    sub = await bus.nc.subscribe(subject, cb=on_msg)
    await bus.nc.flush()
    monkeypatch.setattr(ssl.SSLObject, "write", counted)
    for i in range(count):
        await bus.nc.publish(subject, b"x" * 200 + str(i).encode())
    await bus.nc.flush()
    await asyncio.wait_for(done.wait(), timeout=10)
    monkeypatch.undo()
    await sub.unsubscribe()
    assert [g[200:] for g in got] == [str(i).encode() for i in range(count)]  # every message, in order
    return writes[0]


async def test_a_flush_of_many_publishes_goes_out_in_a_few_tls_records(bus: Bus,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # nats-py hands its pending publishes to the transport as a list; asyncio's TLS transport wrote each as a record
    # of its own (one per publish, each encrypted, sent, and read and decrypted by nats-server on its own).
    assert await tls_writes_for(bus, 500, monkeypatch) <= 20


async def test_a_reconnected_bus_still_joins_its_writes(settings: CommonSettings, nats_conf: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    server = OwnNats(tmp_path, nats_conf)
    bus = await Bus.connect(settings.model_copy(update={"nats_url": server.url}), "test")
    try:
        server.stop()
        server.start()
        deadline = asyncio.get_running_loop().time() + 15
        while not bus.nc.is_connected or bus.nc.stats["reconnects"] == 0:
            assert asyncio.get_running_loop().time() < deadline, "no reconnect"
            await asyncio.sleep(0.1)
        assert await tls_writes_for(bus, 500, monkeypatch) <= 20
    finally:
        await bus.close()
        server.stop()


async def test_a_tls_handshake_reset_by_the_server_is_tried_again_not_waited_on_forever(settings: CommonSettings) -> None:
    # nats-server resets a TLS handshake that outlasts its TLS timeout (a loaded host). nats-py then waited for the
    # close of a stream whose socket start_tls had taken over, a wait that never ends: connect hung for good and a
    # clean-clone run lost a stack's start to it. A front to the session's server resets the first handshake.
    upstream = urlsplit(settings.nats_url)
    attempts = [0]

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            dst.close()

    async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        attempts[0] += 1
        up_reader, up_writer = await asyncio.open_connection(upstream.hostname, upstream.port)
        if attempts[0] == 1:
            writer.write(await up_reader.readline())  # the server's INFO: TLS required
            await writer.drain()
            await reader.read(1)  # the client's hello has begun: reset it
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            up_writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(front, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        bus = await asyncio.wait_for(
            Bus.connect(settings.model_copy(update={"nats_url": f"nats://127.0.0.1:{port}"}), "test"), timeout=20)
        try:
            assert attempts[0] >= 2
            sub = await bus.nc.subscribe(f"{bus.prefix}.after-reset")
            await bus.nc.publish(f"{bus.prefix}.after-reset", b"served")
            assert (await sub.next_msg(timeout=5)).data == b"served"  # the later attempt's connection serves
        finally:
            await bus.close()
    finally:
        server.close()
