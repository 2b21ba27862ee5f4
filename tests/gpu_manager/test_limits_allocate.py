"""Limits on what one client may take (issue 18, part 2): capacity by default from the host's real memory,
chunks per lease, chunk fds per client process, connections per uid. Each is refused with a typed error reply
on a connection that stays usable; the manager keeps serving everyone else."""

from __future__ import annotations

import resource
import socket

import pytest

from libs.client.connection import open_session
from libs.client.memory import MemoryClient
from libs.common.errors import HoldfastError
from tests.gpu_manager.harness import wait_for

MIB = 1 << 20


def _refused(fn) -> str:  # noqa: ANN001
    with pytest.raises(HoldfastError) as e:
        fn()
    return e.value.code


def _host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def test_a_1_tib_allocate_is_refused_by_the_default_host_capacity(manager):
    assert _host_memory() < 1 << 40  # the premise: this host has less than 1 TiB
    with MemoryClient.connect("cap-1tib", socket_path=manager.socket) as client:
        assert _refused(lambda: client.allocate(1 << 40, chunk_size=1 << 30)) == "out_of_memory"
        assert client.allocate(4 * MIB).info.size == 4 * MIB  # the same connection still serves


def test_the_default_capacity_is_a_configurable_fraction_of_host_memory(manager_factory):
    manager = manager_factory(HF_HOST_CAPACITY_FRACTION="0.001").start()
    cap = int(_host_memory() * 0.001)
    with MemoryClient.connect("cap-frac", socket_path=manager.socket) as client:
        assert _refused(lambda: client.allocate(cap + 8 * MIB, chunk_size=64 * MIB)) == "out_of_memory"


def test_256_mib_in_4_kib_chunks_gets_a_typed_too_many_chunks_error(manager):
    with MemoryClient.connect("chunks-4k", socket_path=manager.socket) as client:
        assert _refused(lambda: client.allocate(256 * MIB, chunk_size=4096)) == "too_many_chunks"
        assert client.connected
        assert client.allocate(2 * MIB).info.size == 2 * MIB
    with MemoryClient.connect("chunks-other", socket_path=manager.socket) as other:
        assert other.allocate(MIB).info.size == MIB


def test_chunk_fds_held_by_one_client_are_capped(manager_factory):
    manager = manager_factory(HF_MAX_FDS_PER_CLIENT="8").start()  # 1 MiB chunks in these tests
    with MemoryClient.connect("fds-a", socket_path=manager.socket) as client:
        client.allocate(6 * MIB)
        assert _refused(lambda: client.allocate(4 * MIB)) == "too_many_fds"
        client.allocate(2 * MIB)  # up to the cap exactly
        assert _refused(lambda: client.allocate(MIB)) == "too_many_fds"


def test_one_process_gets_a_share_of_the_managers_fd_limit_and_the_others_keep_room(manager, engines):
    """A small machine's RLIMIT_NOFILE (1024 here) is far below `max_fds_per_client` (65536): one process took every
    fd the reserve left (~700 chunk fds), and the next engine's allocate was refused (issue 20)."""
    _, hard = resource.prlimit(manager.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(manager.pid, resource.RLIMIT_NOFILE, (1024, hard))
    with MemoryClient.connect("fd-hog", socket_path=manager.socket) as hog:
        held = 0
        with pytest.raises(HoldfastError) as refused:
            while True:
                hog.allocate(16 * MIB)  # 16 chunk fds each (1 MiB chunks)
                held += 16
        neighbour = engines(manager, "fd-neighbour")  # another process of the uid: room for as much again
        for _ in range(16):
            assert neighbour.ask('call allocate {"size": 16777216}') == {"code": "ok"}
        assert refused.value.code == "too_many_fds", refused.value
        assert "limit of 256 per client (0.25 of the gpu_manager's RLIMIT_NOFILE of 1024)" in refused.value.message
        assert held == 256
        assert hog.pending() == [] and hog.connected  # the refused client's connection still serves
    assert manager.child is not None and manager.child.alive()


def _hello(path: str, engine_id: str) -> tuple[socket.socket, dict]:
    """The SDK's hello (a refusal sent at accept may close the socket before the hello is sent: the typed reply
    is read all the same)."""
    return open_session(path, engine_id, "default", 5.0)


def _accepted(path: str, engine_id: str) -> socket.socket | None:
    s, reply = _hello(path, engine_id)
    if reply["ok"]:
        return s
    s.close()
    assert reply["error"]["code"] == "too_many_connections", reply
    return None


def test_connections_per_uid_are_capped_with_a_typed_reply(manager_factory):
    manager = manager_factory(HF_MAX_CONNECTIONS_PER_UID="3").start()
    held = [_hello(manager.socket, f"conn-{i}") for i in range(3)]
    try:
        assert all(reply["ok"] for _, reply in held)
        extra, reply = _hello(manager.socket, "conn-extra")
        extra.close()
        assert not reply["ok"] and reply["error"]["code"] == "too_many_connections", reply
        held.pop()[0].close()
        late = wait_for(lambda: _accepted(manager.socket, "conn-late"), timeout=5)  # once the manager saw the close
        held.append((late, {}))
    finally:
        for s, _ in held:
            s.close()
