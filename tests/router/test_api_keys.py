"""The router's API keys, through the official `openai` client and raw HTTP against a real router and engine: a
client without a key, or with a wrong one, gets OpenAI's 401 (`AuthenticationError`) and nothing reaches an engine;
a hashed key from settings or a file serves; a 50 MB body is refused from its headers (413) before it is read,
authenticated or not; `/healthz` stays public; a router given no key makes one into its state dir (0600)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from libs.common.store import Store
from libs.common.web.tokens import new_token
from tests.router.conftest import EngineProc, RouterProc
from tests.router.test_router import MODEL
from tests.support import wait_until

BIG = 50 << 20


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


async def _serving(engines: Callable[[str], EngineProc], store: Store, engine_id: str) -> EngineProc:
    """A pattern engine serving MODEL, in etcd's endpoints for a router to find at start."""
    engine = engines(engine_id)
    await asyncio.to_thread(engine.wait_ready)
    await store.put(f"endpoints/{MODEL}/{engine_id}", engine.url)
    return engine


async def test_only_a_known_key_is_served_and_nothing_else_reaches_an_engine(
        tmp_path: Path, engines: Callable[[str], EngineProc], start_router: Callable[..., RouterProc],
        store: Store) -> None:
    engine = await _serving(engines, store, "keys-a")
    key, entry = new_token("infer")
    file_key, file_entry = new_token("infer")
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{file_entry}\n")
    router = await asyncio.to_thread(start_router, hold_timeout_s=2, api_keys=entry, api_keys_file=keys_file)

    for good in (key, file_key):
        r = await client(router.url, good).completions.create(model=MODEL, prompt="Once", max_tokens=4)
        assert r.choices[0].text
    before = httpx.get(engine.url + "/health", timeout=5).json()
    for bad in ("wrong", entry, key[:-1]):  # and none at all: the raw requests below
        with pytest.raises(openai.AuthenticationError) as err:
            await client(router.url, bad).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    for path in ("/v1/generate", "/stats", "/v1/models"):
        r = httpx.request("POST" if path == "/v1/generate" else "GET", router.url + path,
                          json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(engine.url + "/health", timeout=5).json() == before  # nothing reached the engine
    assert httpx.get(router.url + "/healthz", timeout=5).status_code == 200  # the probe needs no key
    ok = httpx.get(router.url + "/stats", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["requests"] >= 2


def _status_line_after_sending(port: int, headers: str, body_bytes: int) -> bytes:
    """Send the headers and as much of a body as the router reads, then the status line it answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(headers.encode())
        chunk = b"x" * (1 << 20)
        try:
            for _ in range(body_bytes // len(chunk)):
                s.sendall(chunk)
        except OSError:
            pass  # the router closed its side: the answer is already there to read
        return s.recv(4096).split(b"\r\n", 1)[0]


async def test_a_huge_body_is_refused_from_its_headers_with_or_without_a_key(
        start_router: Callable[..., RouterProc]) -> None:
    key, entry = new_token("infer")
    router = await asyncio.to_thread(start_router, api_keys=entry, max_body_bytes=1 << 20)
    rss0 = _rss_kib(router.child.pid)
    for auth in ("", f"Authorization: Bearer {key}\r\n"):
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                f"Content-Length: {BIG}\r\n\r\n")
        line = await asyncio.to_thread(_status_line_after_sending, int(router.url.rsplit(":", 1)[1]), head, BIG)
        assert line.split()[1] == (b"401" if not auth else b"413"), line
    # chunked (no declared length), with a key: counted as read, refused past the limit
    r = httpx.post(router.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   content=iter([b"x" * (1 << 18)] * 16), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert _rss_kib(router.child.pid) - rss0 < 40 * 1024  # the 50 MB bodies were never held


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_a_router_given_no_key_makes_one_readable_by_its_user_only(
        tmp_path: Path, settings_env: dict[str, str], start_router: Callable[..., RouterProc]) -> None:
    state = tmp_path / "state"
    router = await asyncio.to_thread(start_router, state_dir=state, allow_anonymous=False)
    path = state / "router-api-key"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = path.read_text().strip()
    assert len(key) >= 40
    assert httpx.get(router.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(router.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200
    assert key not in (tmp_path / "router.log").read_text()  # never logged


def test_a_bad_key_entry_or_keys_beside_anonymous_stop_the_start(tmp_path: Path,
                                                                  settings_env: dict[str, str]) -> None:
    _, admin_entry = new_token("admin")  # an admin API entry is not a router key
    for extra in (["--api-keys", admin_entry], ["--api-key", "k", "--allow-anonymous", "true"]):
        r = subprocess.run([sys.executable, "-m", "services.router", "--router-port", "0", *extra],
                           env={**settings_env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        said = r.stdout + r.stderr
        assert "token entry starting 'admin'" in said or "allow_anonymous and API keys" in said, said[-2000:]
        assert admin_entry.split(":")[-1] not in said  # the hash is not echoed either


async def test_a_router_on_loopback_with_no_key_configured_serves_anonymous_clients(
        tmp_path: Path, engines: Callable[[str], EngineProc], start_router: Callable[..., RouterProc],
        store: Store) -> None:
    await _serving(engines, store, "anon-a")
    state = tmp_path / "anon-state"
    # allow_anonymous unset (None): the start_router fixture's default is replaced by the setting's own
    router = await asyncio.to_thread(start_router, hold_timeout_s=2, state_dir=state, allow_anonymous=None)
    r = await client(router.url, "anything").completions.create(model=MODEL, prompt="Once", max_tokens=4)
    assert r.choices[0].text
    assert not (state / "router-api-key").exists()
    big = httpx.post(router.url + "/v1/completions", content=b"x" * (17 << 20), timeout=30)
    assert big.status_code == 413  # the body limit holds without keys


async def test_connections_whose_headers_never_complete_are_closed(start_router: Callable[..., RouterProc]) -> None:
    # "slowloris": a header line now and then, or nothing at all; each such connection held an fd forever
    router = await asyncio.to_thread(start_router, header_timeout_s=1.0)
    port = int(router.url.rsplit(":", 1)[1])
    fds0 = len(os.listdir(f"/proc/{router.child.pid}/fd"))
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    for i, s in enumerate(socks):
        if i % 2:
            s.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\n")  # the rest never comes
    await asyncio.sleep(0.5)
    assert len(os.listdir(f"/proc/{router.child.pid}/fd")) >= fds0 + 250  # held while within the bound
    for s in socks[1::2]:
        s.sendall(b"X-Slow: 1\r\n")  # a line now and then does not extend it
    assert httpx.get(router.url + "/healthz", timeout=10).status_code == 200  # others are served meanwhile

    def closed(s: socket.socket) -> bool:
        """The router closes it within 10 s (what it still had to send read first)."""
        s.settimeout(10)
        try:
            while s.recv(4096):
                pass
        except TimeoutError:
            return False
        except OSError:
            pass
        return True

    assert all(await asyncio.to_thread(lambda: [closed(s) for s in socks]))
    for s in socks:
        s.close()
    await wait_until(lambda: len(os.listdir(f"/proc/{router.child.pid}/fd")) < fds0 + 20, within_s=15,
                     what="the router's fds back")
    # a kept-alive connection: the next request's headers have the same bound
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        t0 = time.monotonic()
        assert closed(s) and time.monotonic() - t0 < 5  # its header bound, not the keep-alive's 30 s


def trickle_until_answered(port: int, head: str, declared: int, gap_s: float) -> tuple[int, bytes]:
    """`head` (a POST's request line and headers, each ending CRLF) and `Content-Length: declared`, then the body a
    byte every `gap_s` until the server answers or closes: (bytes of the body sent, all it sent until it closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"{head}Content-Length: {declared}\r\n\r\n".encode())
        sent = 0
        while sent < declared:
            if select.select([s], [], [], gap_s)[0]:
                break  # answered (or closed) before the body was complete
            try:
                s.sendall(b" ")
            except OSError:
                break
            sent += 1
        got = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(4096):
                got += chunk
        return sent, got


async def test_a_body_trickled_a_byte_at_a_time_is_answered_408_and_others_are_served_meanwhile(
        start_router: Callable[..., RouterProc]) -> None:
    # slowloris on the body: whole headers, then a byte now and then held the connection and a request's task forever
    router = await asyncio.to_thread(start_router, body_timeout_s=1.0)
    port = int(router.url.rsplit(":", 1)[1])
    declared = 100  # a byte every 0.1 s: 10 s to complete, ten times the bound
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    trickles = [asyncio.create_task(asyncio.to_thread(trickle_until_answered, port, head, declared, 0.1))
                for _ in range(4)]
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as c:
        served = 0
        while not served or not all(t.done() for t in trickles):  # others are served during the trickles
            served += 1
            r = await c.post("/v1/completions", json={"model": "nobody-serves-this", "prompt": "x"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            await asyncio.sleep(0.05)
    for sent, got in [t.result() for t in trickles]:
        assert sent < declared, "the body was read to its end: no bound"
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), got[:200]
        assert b"connection: close" in head.lower()
        error = json.loads(body)["error"]  # OpenAI's shape, as the guard's refusals
        assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
