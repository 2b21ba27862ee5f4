"""Every SDK call on the gpu_manager socket has a timeout and raises a typed error when it passes (issue 18,
part 2): a manager that accepts but never answers (here: a real one, stopped with SIGSTOP) cannot hang an
engine inside `MemoryClient.connect` or any request."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from libs.client.memory import MemoryClient
from libs.common.errors import CommandTimeout, HoldfastError

TIMEOUT_S = 0.5


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setenv("HF_GPU_MANAGER_TIMEOUT_S", str(TIMEOUT_S))


def _bounded(fn, limit: float):  # noqa: ANN001, ANN202
    """Run `fn` in a thread; fail if it has not returned or raised within `limit` seconds (a hang)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"still blocked after {limit} s"
    return out, time.monotonic() - t0


@pytest.fixture
def stopped(manager):  # noqa: ANN001
    """The manager, and a way to freeze it (SIGSTOP): it stays connected, accepts in the backlog, answers nothing."""
    frozen = []

    def stop() -> None:
        os.kill(manager.pid, signal.SIGSTOP)
        frozen.append(True)

    yield stop
    if frozen:
        os.kill(manager.pid, signal.SIGCONT)


def test_connect_to_a_manager_that_never_answers_raises_a_typed_timeout(manager, stopped, short_timeout):
    stopped()
    out, took = _bounded(lambda: MemoryClient.connect("to-frozen", socket_path=manager.socket), 5)
    assert isinstance(out.get("error"), CommandTimeout), out
    assert out["error"].code == "timeout" and took < TIMEOUT_S + 2


def test_a_request_the_manager_never_answers_raises_a_typed_timeout_and_the_client_recovers(
        manager, stopped, short_timeout):
    client = MemoryClient.connect("req-frozen", socket_path=manager.socket)
    try:
        lease = client.allocate(1 << 20)
        stopped()
        for call in (client.pending, lambda: client.allocate(1 << 20), client.heartbeat):
            out, took = _bounded(call, 5)
            assert isinstance(out.get("error"), CommandTimeout), out
            assert took < TIMEOUT_S + 2
        os.kill(manager.pid, signal.SIGCONT)
        assert client.pending() == []  # reconnected by itself (hello + resume), the lease still its own
        assert lease.id in client.leases and client.reconnects >= 1
    finally:
        client.close()


def test_an_explicit_timeout_overrides_the_environment(manager, stopped):
    stopped()
    out, took = _bounded(lambda: MemoryClient.connect("explicit", socket_path=manager.socket, timeout_s=0.3), 5)
    assert isinstance(out.get("error"), HoldfastError) and out["error"].code == "timeout"
    assert took < 2


def test_a_connection_the_manager_closed_while_idle_is_reopened_before_an_allocate(manager_factory):
    manager = manager_factory(HF_IDLE_TIMEOUT_S="0.3").start()
    with MemoryClient.connect("idle-sdk", socket_path=manager.socket) as client:
        first = client.allocate(1 << 20)
        time.sleep(1.0)  # the manager closes the silent connection meanwhile
        second = client.allocate(1 << 20)  # not repeatable, yet sent: the close was seen before sending
        assert client.reconnects == 1 and {first.id, second.id} <= set(client.leases)
