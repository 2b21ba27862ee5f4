"""libs/common/procs.py: the ports handed to the servers a stack or benchmark starts."""

import socket
import sys

import pytest

from libs.common import procs


def test_free_port_never_hands_the_same_port_twice() -> None:
    # The kernel reuses a closed ephemeral port often (a few repeats in 300 binds on this machine): nats-server and
    # etcd's peer listener once got the same one, and the benchmark waited on etcd for NATS.
    ports = [procs.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_free_port_keeps_finding_ports_when_the_kernel_repeats_one(monkeypatch) -> None:  # noqa: ANN001
    """A kernel that answers bind(port 0) with the same port again and again (it may, once the first socket is
    closed) must not make free_port spin: under pytest-xdist a worker's filter (only its own ports) once turned
    that into a 300 s hang in a fixture."""
    real_bind = socket.socket.bind

    def bind(self: socket.socket, addr: tuple[str, int]) -> None:
        real_bind(self, addr)
        if addr[1] == 0:
            raise AssertionError("free_port asked the kernel for a port")

    monkeypatch.setattr(socket.socket, "bind", bind)
    # (under pytest-xdist the worker's own class applies too: a residue mod 4 or 6, which this one meets)
    ports = [procs.free_port(accept=lambda port: port % 5 == 1) for _ in range(50)]
    assert len(set(ports)) == 50 and all(port % 5 == 1 for port in ports)
    assert all(procs.PORT_RANGE[0] <= port < procs.PORT_RANGE[1] for port in ports)


def test_free_port_skips_a_port_someone_listens_on() -> None:
    busy = procs.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        procs._HANDED_OUT.discard(busy)  # as if another process had been handed it: only the listener tells
        # one residue class of 1-3 workers (mod 2, 4 or 6): the busy port and twenty others of it (one alone could
        # be in use too: a clean-clone run found busy + 6 taken and no port left)
        step = 12 if busy + 12 * 20 < procs.PORT_RANGE[1] else -12
        near = {busy + step * k for k in range(21)}
        assert procs.free_port(accept=lambda port: port in near) != busy


def test_a_port_class_from_the_environment_is_parsed_and_a_bad_one_refused() -> None:
    assert procs._port_class(None) is None and procs._port_class("") is None
    assert procs._port_class("5/6") == (5, 6)
    for bad in ("6/6", "x/2", "1", "-1/4", "1/0"):
        with pytest.raises(ValueError, match="HF_PORT_CLASS"):
            procs._port_class(bad)


def test_waiting_for_a_childs_port_is_not_fooled_by_another_process_listening_there(tmp_path) -> None:
    # A port drawn free may be taken before the child binds it: the child exits, and the port is open all along.
    # Waiting must name that, not return as though the child listened (a client would then talk to a stranger).
    busy = procs.free_port()
    listen = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); " \
             "s.listen(); time.sleep(30)"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        late = procs.Child("late", [sys.executable, "-c", listen, str(busy)], log_path=tmp_path / "late.log").start()
        try:
            with pytest.raises(RuntimeError, match="late exited before listening .*another process listens there"):
                procs.wait_port(busy, late, timeout=15)
        finally:
            late.stop()
        idle = procs.Child("idle", ["sleep", "30"]).start()
        try:
            with pytest.raises(TimeoutError, match="idle listens .* after 0.5s; another process listens there"):
                procs.wait_port(busy, idle, timeout=0.5)
        finally:
            idle.stop()
    # the child's own listener, and one of its group's (a shell that runs the server)
    for argv in ([sys.executable, "-c", listen], ["bash", "-c", f"{sys.executable} -c \"{listen}\" \"$0\"; true"]):
        port = procs.free_port()
        own = procs.Child("own", [*argv, str(port)]).start()
        try:
            procs.wait_port(port, own, timeout=15)
            assert procs.listens(own, port)
        finally:
            own.stop()
