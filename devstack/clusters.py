"""Three-member etcd and NATS clusters on loopback: `holdfast up --ha` and the failover tests run them.

Each member is a `procs.Child` of its own (name `etcd-<i>` / `nats-<i>`), so a test or a chaos run kills one
by name and the stack's supervision restarts it with the same flags and data (an etcd member restarted on its
data directory rejoins; its `--initial-cluster` flags are then ignored). Peers and routes speak plaintext on
loopback; clients speak what `tls_flags` / `config` say (TLS and auth in the stack).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from libs.common import procs


@dataclass(frozen=True)
class Member:
    name: str
    port: int  # clients
    peer_port: int  # etcd's peers, NATS's routes


def members(kind: str, size: int = 3) -> tuple[Member, ...]:
    """`size` members of `kind` ('etcd' or 'nats') on free loopback ports."""
    return tuple(Member(f"{kind}-{i}", procs.free_port(), procs.free_port()) for i in range(size))


def client_urls(kind: str, ms: tuple[Member, ...]) -> str:
    """What clients are given: every member, comma-separated (`HF_ETCD_ENDPOINTS` / `HF_NATS_URL`)."""
    scheme = "nats://" if kind == "nats" else ""
    return ",".join(f"{scheme}127.0.0.1:{m.port}" for m in ms)


def etcd_children(ms: tuple[Member, ...], base_dir: Path, logs: Path, *,
                  tls_flags: list[str] | None) -> list[procs.Child]:
    cluster = {m.name: m.peer_port for m in ms}
    return [procs.etcd_server(m.port, m.peer_port, base_dir / m.name, logs / f"{m.name}.log", tls_flags=tls_flags,
                              name=m.name, initial_cluster=cluster) for m in ms]


def nats_children(ms: tuple[Member, ...], base_dir: Path, logs: Path, *, config: Path | None) -> list[procs.Child]:
    return [procs.nats_server(m.port, base_dir / m.name, logs / f"{m.name}.log", config=config, name=m.name,
                              cluster_port=m.peer_port, routes=tuple(o.peer_port for o in ms if o is not m))
            for m in ms]


def start(ms: tuple[Member, ...], children: list[procs.Child]) -> list[procs.Child]:
    """Start every member, then wait until each listens (all at once: a member waits for its peers)."""
    for child in children:
        child.start()
    for m, child in zip(ms, children, strict=True):
        procs.wait_port(m.port, child)
    return children
