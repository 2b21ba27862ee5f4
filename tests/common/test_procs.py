"""libs/common/procs.py: the ports handed to the servers a stack or benchmark starts."""

import socket

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
    # (under pytest-xdist the worker's own filter applies too: a residue class mod 2 or 3, which this one meets)
    ports = [procs.free_port(accept=lambda port: port % 5 == 1) for _ in range(50)]
    assert len(set(ports)) == 50 and all(port % 5 == 1 for port in ports)
    assert all(procs.PORT_RANGE[0] <= port < procs.PORT_RANGE[1] for port in ports)


def test_free_port_skips_a_port_someone_listens_on() -> None:
    busy = procs.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        procs._HANDED_OUT.discard(busy)  # as if another process had been handed it: only the listener tells
        # one residue class of 1-3 workers: the busy port and twenty others of it (one alone could be in use too:
        # a clean-clone run found busy + 6 taken and no port left)
        step = 6 if busy + 6 * 20 < procs.PORT_RANGE[1] else -6
        near = {busy + step * k for k in range(21)}
        assert procs.free_port(accept=lambda port: port in near) != busy
