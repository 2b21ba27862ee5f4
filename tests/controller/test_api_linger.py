"""A client that sends its whole body before it reads (most do: http.client, requests, the chaos run's loops) gets
its 401 or 413 as a status line, not a reset (issue 18: 0 status lines for 8 MiB bodies in the chaos runs): the
API answers from the headers at once, then reads and drops what the client still sends before it closes
(api/linger.py). A real controller process over HTTP; bodies of 8 and 50 MB."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from libs.common.bus import Bus
from libs.common.store import Store
from tests.controller.test_api_guard import ADMIN, api, serving_api  # noqa: F401 - the fixture
from tests.router.test_api_keys import trickle_until_answered

pytestmark = pytest.mark.timeout(120)


def send_all_then_read(port: int, headers: str, total: int) -> bytes:
    """POST a `total`-byte body, all of it, and only then read the answer's status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST /v1/engines/e/failover HTTP/1.1\r\nHost: x\r\n{headers}Content-Type: application/json\r\n"
                     f"Content-Length: {total}\r\n\r\n".encode())
        chunk = b"x" * (1 << 20)
        sent = 0
        while sent < total:
            sent += sock.send(chunk[: total - sent])
        return sock.recv(4096).split(b"\r\n", 1)[0]


@pytest.mark.parametrize("total", [8 << 20, 50_000_000])
async def test_a_refused_body_sent_in_full_still_gets_its_status_line(api: tuple[str, int, str],  # noqa: F811
                                                                      total: int) -> None:
    url, _, _ = api
    port = int(url.rsplit(":", 1)[1])
    assert send_all_then_read(port, "", total) == b"HTTP/1.1 401 Unauthorized"
    assert send_all_then_read(port, "Authorization: Bearer wrong\r\n", total) == b"HTTP/1.1 401 Unauthorized"
    assert send_all_then_read(port, f"Authorization: Bearer {ADMIN}\r\n", total) == b"HTTP/1.1 413 Request Entity Too Large"


async def test_a_body_trickled_a_byte_at_a_time_is_answered_408_in_the_admin_shape(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    # the body's slowloris: whole headers, then a byte now and then held the connection and the request's task
    async with serving_api(bus, store, settings_env, tmp_path, HF_API_BODY_TIMEOUT_S="1") as (url, _, _):
        head = (f"POST /v1/engines/e/failover HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
                "Content-Type: application/json\r\n")
        declared = 100  # a byte every 0.1 s: 10 s to complete, ten times the bound
        sent, got = await asyncio.to_thread(trickle_until_answered, int(url.rsplit(":", 1)[1]), head, declared, 0.1)
    assert sent < declared, "the body was read to its end: no bound"
    status, _, body = got.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408"), got[:200]
    assert json.loads(body)["error"] == "request_timeout"
