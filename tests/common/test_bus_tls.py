"""The bus's connection over TLS (the session's nats-server requires it): what TLS costs per message."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings


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
    port = procs.free_port()

    def server() -> procs.Child:
        child = procs.nats_server(port, tmp_path / "nats", tmp_path / "nats.log", config=nats_conf).start()
        procs.wait_port(port, child)
        return child

    child = server()
    bus = await Bus.connect(settings.model_copy(update={"nats_url": f"nats://127.0.0.1:{port}"}), "test")
    try:
        child.stop()
        child = server()
        deadline = asyncio.get_running_loop().time() + 15
        while not bus.nc.is_connected or bus.nc.stats["reconnects"] == 0:
            assert asyncio.get_running_loop().time() < deadline, "no reconnect"
            await asyncio.sleep(0.1)
        assert await tls_writes_for(bus, 500, monkeypatch) <= 20
    finally:
        await bus.close()
        child.stop()
