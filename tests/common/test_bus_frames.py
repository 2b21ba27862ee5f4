"""The bus's own frames (libs/common/bus/frames.py) against nats-py's `publish` on a real nats-server: a subscriber
sees the same message either way, and a frame is refused where nats-py refuses a publish."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.msg import Msg
from nats.errors import BadHeaderError, BadSubjectError, ConnectionClosedError, MaxPayloadError

from libs.common.bus import Bus, frames


def _seen(msg: Msg) -> tuple[str, str, dict[str, str] | None, bytes]:
    return msg.subject, msg.reply, msg.headers, msg.data


@pytest.mark.parametrize("headers", [
    {},
    {"Nats-Msg-Id": "inc-1-opened", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    {"hf-id": "  padded  ", "tracestate": "a=1\r\nPUB x 1\r\n"},  # a value cannot end its line nor add a frame
])
@pytest.mark.parametrize("reply", ["", "_INBOX.test.7"])
async def test_a_frame_reaches_a_subscriber_as_nats_py_publish_sends_it(bus: Bus, headers: dict[str, str],
                                                                         reply: str) -> None:
    nc = bus.link.nc
    assert bus.link.fast, "this nats-py lacks what frames.send relies on: the test would check nats-py against itself"
    got: asyncio.Queue[Msg] = asyncio.Queue()
    sub = await nc.subscribe("frames.test.>", cb=got.put)
    await nc.flush()
    body = 'payload "é"\r\nwith a line break'.encode()
    await nc.publish("frames.test.a", body, reply=reply, headers=headers or None)
    await frames.send(nc, "frames.test.a", body, reply, frames.header_block(headers), fast=True)
    theirs, ours = (await asyncio.wait_for(got.get(), 2)), (await asyncio.wait_for(got.get(), 2))
    assert _seen(ours) == _seen(theirs)
    assert got.empty()
    await sub.unsubscribe()


async def test_a_frame_is_refused_where_nats_py_refuses_a_publish(bus: Bus) -> None:
    nc = bus.link.nc
    with pytest.raises(BadSubjectError):
        bus.link.subjects.check("frames.bad subject")
    with pytest.raises(BadHeaderError):
        frames.header_block({"bad name": "x"})
    with pytest.raises(MaxPayloadError):
        await frames.send(nc, "frames.test.big", b"x" * (nc.max_payload + 1), "", b"", fast=True)


async def test_a_frame_on_a_closed_connection_raises(bus: Bus) -> None:
    nc = bus.link.nc
    await nc.close()
    with pytest.raises(ConnectionClosedError):
        await frames.send(nc, "frames.test.closed", b"x", "", b"", fast=True)


@pytest.mark.parametrize("raw", [
    b"Nats-Msg-Id: inc-1-opened\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\r\n",
    b"a:b\r\nc:\td \r\n\r\n",  # no space after the colon, a tab
    b"bad name: x\r\nbad\x1cname: y\r\n\x1cedge: z\r\nok: 1\r\n",  # whitespace in or around a name (\x1c is one)
    b"caf\xc3\xa9: x\r\nv: caf\xc3\xa9 \xff\r\n",  # a non-ASCII name is skipped; a bad UTF-8 value is replaced
    b"no colon\r\n\r\n: empty name\r\n",
    b"",
])
def test_the_connections_header_parse_is_nats_pys_for_every_kind_of_line(raw: bytes) -> None:
    from nats.aio.client import Client

    from libs.common.bus.connection import Connection

    assert Connection._parse_header_lines(raw) == Client._parse_header_lines(raw)
