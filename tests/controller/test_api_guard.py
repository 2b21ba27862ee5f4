"""The admin API decides from the headers before reading a body: an unauthenticated 50 MB POST gets 401 at
once and the controller's memory does not grow; an authenticated body over the limit gets 413 (declared or
chunked); ordinary requests are served as before. A real controller process over HTTP."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from libs.common import procs
from libs.common.bus import Bus
from libs.common.store import Store
from libs.common.web.guard import verdict
from tests.controller.helpers import control_plane, service_env, serving_cluster, wait_for

ADMIN = "admin-secret"
LIMIT = 64 * 1024
BIG = 50 << 20


def test_the_verdict_comes_from_the_headers_alone() -> None:
    auth = {b"authorization": f"Bearer {ADMIN}".encode()}
    assert verdict("/v1/nodes", {b"content-length": b"99999999"}, ADMIN, "", LIMIT)[0] == 401  # type: ignore[index]
    assert verdict("/v1/nodes", {**auth, b"content-length": b"99999999"}, ADMIN, "", LIMIT)[0] == 413  # type: ignore[index]
    assert verdict("/v1/nodes", {**auth, b"content-length": b"12"}, ADMIN, "", LIMIT) is None
    assert verdict("/healthz", {}, ADMIN, "", LIMIT) is None
    assert verdict("/v1/nodes", {b"authorization": b"Bearer wrong"}, ADMIN, "", LIMIT)[0] == 401  # type: ignore[index]


@pytest.fixture
async def api(bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> AsyncIterator[tuple[str, int, str]]:
    async with serving_api(bus, store, settings_env, tmp_path) as served:
        yield served


@contextlib.asynccontextmanager
async def serving_api(bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path,
                      **env: str) -> AsyncIterator[tuple[str, int, str]]:
    """A controller serving its API (admin token `ADMIN`, body limit `LIMIT`, more settings `env`) over a simulated
    node: (its URL, the controller's pid, an engine's id)."""
    sim = await serving_cluster(bus, store, nodes=1, gpus_per_node=1)
    port = procs.free_port()
    env = service_env(settings_env, HF_API_ENABLED="true", HF_API_PORT=str(port), HF_ADMIN_TOKEN=ADMIN,
                      HF_API_MAX_BODY_BYTES=str(LIMIT), **env)
    async with control_plane(bus, store, env, tmp_path, dc_manager=False) as children:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            await wait_for(lambda: _served(c), what="the API up")
        yield url, children["c1"].pid, sim.engine_id("n0000", 0)


async def _served(c: httpx.AsyncClient) -> bool:
    try:
        return (await c.get("/v1/nodes")).status_code == 200
    except httpx.HTTPError:
        return False


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _post_big(port: int, headers: str, total: int) -> tuple[bytes, float, int]:
    """Send a POST with a `total`-byte body as fast as the server takes it, reading its answer beside.
    Returns (the answer's first bytes, seconds from the first byte sent to the answer, bytes sent)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10.0)
    got: list[bytes] = []
    answered: list[float] = []

    def reader() -> None:
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        answered.append(time.monotonic())
        got.append(data)

    t = threading.Thread(target=reader, daemon=True)
    start = time.monotonic()
    sock.sendall(f"POST /v1/engines/e/failover HTTP/1.1\r\nHost: x\r\n{headers}Content-Type: application/json\r\n"
                 f"Content-Length: {total}\r\n\r\n".encode())
    t.start()
    chunk = b"x" * (1 << 20)
    sent = 0
    try:
        while sent < total and not answered:
            sent += sock.send(chunk[: total - sent])
    except OSError:
        pass  # the server closed the connection: expected once it has answered
    t.join(10.0)
    sock.close()
    return (got[0] if got else b""), (answered[0] - start if answered else float("inf")), sent


async def test_an_unauthenticated_huge_body_is_refused_unread_and_memory_stays_flat(api: tuple[str, int, str]) -> None:
    url, pid, _ = api
    port = int(url.rsplit(":", 1)[1])
    before = _rss_kib(pid)
    answer, after_s, sent = _post_big(port, "", BIG)
    grown = _rss_kib(pid) - before
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert after_s < 2.0, f"401 after {after_s:.2f} s"
    assert sent < BIG // 2, f"{sent} of {BIG} bytes taken before the answer"
    assert grown < 8 * 1024, f"controller RSS grew by {grown} KiB"


async def test_an_authenticated_body_over_the_limit_is_413_declared_or_chunked(api: tuple[str, int, str]) -> None:
    url, pid, engine = api
    port = int(url.rsplit(":", 1)[1])
    answer, after_s, _ = _post_big(port, f"Authorization: Bearer {ADMIN}\r\n", BIG)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert after_s < 2.0

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b" " * (LIMIT // 4)

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        r = await c.post(f"/v1/engines/{engine}/failover", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"] == "payload_too_large"
        # Ordinary requests are served as before, on fresh connections and with bodies under the limit.
        assert (await c.get("/v1/nodes")).status_code == 200
        r = await c.post("/v1/engines/no-such-engine/failover", json={"successor": "x" * 100})
        assert r.status_code == 404
        r = await c.post(f"/v1/engines/{engine}/failover", json={})
        assert r.status_code == 202, r.text
        assert (await httpx.AsyncClient(base_url=url).get("/healthz")).status_code == 200
