"""The engine socket's accept loop under file-descriptor exhaustion (issue 18, part 2): it backs off, logs
once per episode, keeps serving once fds free up, and health says `degraded` with the reason meanwhile."""

from __future__ import annotations

import json
import os
import resource
import socket
import time

import nats.errors

from libs.client.protocol import Hello
from libs.common.wire import recv_frame, send_frame
from tests.gpu_manager.harness import until

HOGS = 40


async def _health(bus, settings) -> dict:  # noqa: ANN001
    """The manager's health detail; {} when the request times out (a loaded machine) or nothing answers yet (the
    fixture waits for the engine socket, which the manager serves before it announces its health): asked again."""
    try:
        msg = await bus.nc.request(f"{settings.subject_prefix}.health.gpu_manager", b"", timeout=3)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return {}
    return json.loads(msg.data)["detail"]


def _hello(path: str, engine_id: str, timeout: float) -> dict:
    """One hello on a fresh connection, bounded: a manager that stopped accepting makes this time out."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        send_frame(s, Hello(engine_id=engine_id).model_dump(mode="json"))
        reply, fds = recv_frame(s)
        assert not fds
        return reply


async def test_accept_survives_fd_exhaustion_reports_it_and_serves_again(manager, bus, settings):
    assert _hello(manager.socket, "before", 5)["ok"]
    # The manager's fd table: what it holds now plus a few, so queued connections hit EMFILE at accept.
    in_use = len(os.listdir(f"/proc/{manager.pid}/fd"))
    _, hard = resource.prlimit(manager.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(manager.pid, resource.RLIMIT_NOFILE, (in_use + 6, hard))
    hogs = []
    try:
        for _ in range(HOGS):  # connect succeeds (the listen backlog) even when accept cannot
            s = socket.socket(socket.AF_UNIX)
            s.connect(manager.socket)
            hogs.append(s)
        t_full = time.monotonic()
        detail = await until(lambda: _degraded(bus, settings), timeout=20)
        # health answers while the table is full (listing the fds needs one: it failed, unanswered ~50 s)
        assert time.monotonic() - t_full < 10
        assert "EMFILE" in detail["degraded"]["accept"] or "Too many open files" in detail["degraded"]["accept"]
        assert detail["fds"]["limit"] == in_use + 6
    finally:
        for s in hogs:
            s.close()
    # The hogs are gone (as a flood of chunk fds would be once its leases are reclaimed): under the same
    # limit, a new engine is accepted and answered, and health is back to ok.
    t0 = time.monotonic()
    reply = await until(lambda: _try_hello(manager.socket), timeout=10)
    assert reply["ok"] and time.monotonic() - t0 < 5
    detail = await until(lambda: _ok(bus, settings), timeout=20)
    assert "accept" not in detail.get("degraded", {})
    assert _hello(manager.socket, "later", 5)["ok"]  # the first accept after the quiet spell logs the end
    log = manager.log()
    assert log.count("cannot accept") == 1, log  # once per episode, not once per retry
    assert "accepting again" in log


async def _degraded(bus, settings) -> dict | None:  # noqa: ANN001
    detail = await _health(bus, settings)
    return detail if detail.get("status") == "degraded" and "accept" in detail.get("degraded", {}) else None


async def _ok(bus, settings) -> dict | None:  # noqa: ANN001
    detail = await _health(bus, settings)
    return detail if detail.get("status") == "ok" else None


def _try_hello(path: str) -> dict | None:
    try:
        return _hello(path, "after", 1)
    except OSError:
        return None
