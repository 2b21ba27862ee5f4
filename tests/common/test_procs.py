"""libs/common/procs.py: the ports handed to the servers a stack or benchmark starts."""

from libs.common import procs


def test_free_port_never_hands_the_same_port_twice() -> None:
    # The kernel reuses a closed ephemeral port often (a few repeats in 300 binds on this machine): nats-server and
    # etcd's peer listener once got the same one, and the benchmark waited on etcd for NATS.
    ports = [procs.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
