"""A client that sends its whole body before it reads (most do: http.client, requests, the chaos run's loops) gets
its 401 or 413 as a status line, not a reset (issue 18: 0 status lines for 8 MiB bodies in the chaos runs): the
API answers from the headers at once, then reads and drops what the client still sends before it closes
(api/linger.py). A real controller process over HTTP; bodies of 8 and 50 MB."""

from __future__ import annotations

import socket

import pytest

from tests.controller.test_api_guard import ADMIN, api  # noqa: F401 - the fixture

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
