"""Who may do what on the bus and in the store: pure tables, no I/O (security/__init__.py says why).

An *identity* is one credential: `controller`, `dc_manager`, `router`, `admin` (operators, the CLI, tests and
benchmarks), and per node `agent.<node>` and `gpu_manager.<node>`. Its NATS user (an nkey) gets the subject
permissions of `nats_permissions`; its etcd user (the client certificate's CN) gets the key ranges of
`etcd_ranges`. Invariants (tests/common/test_security_*.py):
1. a node's agent and gpu_manager subscribe only to their own node's command subjects, publish commands only
   to their own node (the agent's `share_weights` to its gpu_manager), and publish events only on their own
   node's event subjects (`<prefix>.fault.detected.<node>`: no node can fault another node's engine; the
   controller also refuses an event whose envelope names another node, or an engine of another node);
2. only the dc_manager publishes every node command (a TP group's `freeze_gang` among them: its recover intents);
   the controller publishes `reclaim`, `reclaim_gang`, `thaw` and `agent.stop` (forced reclaim of a lease or of a TP
   group's whole gang, cold-start clean-up: its admin operations; the memory of a failed on-purpose incident's
   engine that serves on), snapshots and sleeps, and nothing else on `node.`; the gpu_manager
   serves `freeze_gang` and `reclaim_gang` on its own node's subjects;
3. the router subscribes to router events only and publishes nothing but replies;
4. each identity reads replies on its own inbox prefix only (`inbox_prefix`), so no one reads another's
   replies (a `ListLeases` answer, a stream ack);
5. JetStream consumers (`$JS.API.CONSUMER.*`, acks) belong to the controller and the dc_manager alone, and so do
   the stream's creation and config (`STREAM_MANAGERS`; every other identity reads its info only);
6. a node's service answers health requests for its own node only; only the controller (and operators) write
   `leader/` in etcd.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.common.events import (
    EngineReady,
    EngineReattached,
    EngineStarted,
    EngineStopped,
    Event,
    FaultDetected,
    Freeze,
    GpuHealth,
    LeaseChanged,
    MemoryFrozen,
    Reclaim,
    ReclaimGang,
    SetGpuHealth,
    ShareWeights,
    SleepEngine,
    SnapshotLease,
    StopEngine,
    Thaw,
    command_kind,
    event_subject,
)

ADMIN = "admin"
ROOT = "root"  # etcd's root user: set-up only (users, roles, auth enable); no service runs as it
CLUSTER_ROLES = ("controller", "dc_manager", "router")
NODE_ROLES = ("agent", "gpu_manager")
SERVICE_OF_SOURCE = {"controller-api": "controller"}  # a bus `source` naming a part of a service


class UnknownIdentity(ValueError):
    pass


def node_identity(role: str, node: str) -> str:
    return f"{role}.{node}"


def identity_for(source: str, node: str) -> str:
    """The identity a connection with this bus `source` ('<service>:<instance>') uses: a service's own; any
    other source (the CLI, `holdfast up`'s health checks, tests, benchmarks) is an operator: `admin`."""
    service = source.split(":", 1)[0]
    service = SERVICE_OF_SOURCE.get(service, service)
    if service in NODE_ROLES:
        return node_identity(service, node)
    if service in CLUSTER_ROLES:
        return service
    return ADMIN


def identities(nodes: list[str] | tuple[str, ...]) -> list[str]:
    """Every identity of a cluster with these nodes (the etcd root user apart)."""
    return [ADMIN, *CLUSTER_ROLES, *(node_identity(r, n) for n in nodes for r in NODE_ROLES)]


def split_identity(identity: str) -> tuple[str, str | None]:
    role, _, node = identity.partition(".")
    if role in NODE_ROLES and node:
        return role, node
    if identity in (ADMIN, *CLUSTER_ROLES):
        return identity, None
    raise UnknownIdentity(f"no such identity: {identity!r}")


def inbox_prefix(identity: str) -> str:
    """Where this identity's replies come (a subject token: no dots)."""
    return "_INBOX_" + identity.replace(".", "_")


@dataclass(frozen=True)
class Permissions:
    """Allowed subjects; `None` for both: everything (the admin)."""

    publish: tuple[str, ...] | None
    subscribe: tuple[str, ...] | None


# The events each node role publishes, each on its own node's subject only (events.NODE_EVENTS).
NODE_EVENTS_OF: dict[str, tuple[type[Event], ...]] = {
    "agent": (FaultDetected, EngineStarted, EngineReady, EngineStopped, EngineReattached),
    "gpu_manager": (MemoryFrozen, LeaseChanged, GpuHealth),
}


# Who creates and updates the event stream (`Bus.connect`: the first one up creates it, each start sets its
# config): the control plane, which consumes it, and operators (`holdfast up`'s deploy step). Every other identity
# only reads its info: a stream's config names its subjects, its republish targets and its seal, so one that could
# rewrite it could read everyone's replies, answer a node's commands with stream acks, store no node's events, or
# seal the stream for good (every publish then refused). Probed on 2026-12-06 with the router's credentials.
STREAM_MANAGERS = ("controller", "dc_manager")


def manages_stream(identity: str) -> bool:
    return split_identity(identity)[0] in (ADMIN, *STREAM_MANAGERS)


def _stream_access(stream: str, *, manage: bool) -> list[str]:
    ops = ("INFO", "CREATE", "UPDATE") if manage else ("INFO",)
    return [f"$JS.API.STREAM.{op}.{stream}" for op in ops] + ["$JS.API.INFO"]


def _consumers(stream: str) -> list[str]:
    # MSG.NEXT: a pull consumer's fetch (libs/common/bus/durable.py), one token deeper than the other calls.
    return [f"$JS.API.CONSUMER.*.{stream}", f"$JS.API.CONSUMER.*.{stream}.>", f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
            f"$JS.API.STREAM.MSG.GET.{stream}", "$JS.API.STREAM.NAMES", f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"]


def nats_permissions(identity: str, prefix: str, stream: str) -> Permissions:
    """The subjects `identity` may publish and subscribe to. `prefix`/`stream`: the cluster's subject prefix and
    stream name (`*` in the test fixtures, whose tests each use their own)."""
    role, node = split_identity(identity)
    if role == ADMIN:
        return Permissions(None, None)
    p = prefix
    # its health subjects: a node's service its own node's only (instance = node: libs/common/service.py), so no
    # node answers for another's (a dead agent said healthy); the bare one is any instance's by design
    sub = [f"{inbox_prefix(identity)}.>", f"{p}.health.{role}", f"{p}.health.{role}." + (node or ">")]
    pub = _stream_access(stream, manage=role in STREAM_MANAGERS)
    if role == "agent":
        sub.append(f"{p}.node.{node}.agent.>")
        # its own node's gpu_manager only: a weights share for a standby, a GPU's health, and a freeze (its own
        # promotion of a standby, services/agent/takeover.py: it may kill those engines anyway)
        pub += [f"{p}.node.{node}.{command_kind(ShareWeights)}", f"{p}.node.{node}.{command_kind(SetGpuHealth)}",
                f"{p}.node.{node}.{command_kind(Freeze)}"]
    elif role == "gpu_manager":
        sub.append(f"{p}.node.{node}.gpu_manager.>")
    if node is not None:
        pub += [event_subject(p, event, node) for event in NODE_EVENTS_OF[role]]
    elif role == "controller":
        pub += [f"{p}.incident.>", f"{p}.intent.recover", f"{p}.router.endpoint.>",
                f"{p}.node.*.{command_kind(Reclaim)}", f"{p}.node.*.{command_kind(ReclaimGang)}",
                f"{p}.node.*.{command_kind(StopEngine)}", f"{p}.node.*.{command_kind(Thaw)}",
                f"{p}.node.*.{command_kind(SnapshotLease)}", f"{p}.node.*.{command_kind(SleepEngine)}",
                *_consumers(stream)]
    elif role == "dc_manager":
        pub += [f"{p}.intent.result", f"{p}.node.*.agent.>", f"{p}.node.*.gpu_manager.>", *_consumers(stream)]
    elif role == "router":
        sub.append(f"{p}.router.endpoint.>")
    return Permissions(tuple(pub), tuple(sub))


# ---------------------------------------------------------------- etcd

@dataclass(frozen=True)
class KeyRange:
    """etcd's [key, range_end) with `write` or read only; a prefix range ends at the prefix's successor."""

    key: str
    write: bool
    prefix: bool = True

    def bounds(self) -> tuple[bytes, bytes]:
        key = self.key.encode()
        if not self.prefix:
            return key, b""
        end = bytearray(key)
        end[-1] += 1  # the prefix's successor: every key that starts with it sorts before this
        return key, bytes(end)


def etcd_ranges(identity: str, prefix: str) -> list[KeyRange]:
    """The key ranges `identity` may read or write under the cluster's etcd `prefix` (ends with '/').

    What each service writes (and why it may): agent: `nodes/<node>`, `agents/<node>/`, `engines/<node>/` (its
    own engines' records); gpu_manager: `allocations/<node>/`, `gpus/<node>/`;
    dc_manager: its progress records `dcm/`; controller: everything (incidents, endpoints, drain,
    rollouts, leader, and the clean-up of what a dead node left); router: reads `endpoints/` and `recoveries/`
    (incidents bringing a routed-out model's successor in) only."""
    role, node = split_identity(identity)
    if role in (ADMIN, "controller"):
        return [KeyRange(prefix, write=True)]
    if role == "router":
        return [KeyRange(prefix + "endpoints/", write=False), KeyRange(prefix + "recoveries/", write=False)]
    read_all = KeyRange(prefix, write=False)
    if role == "dc_manager":
        # no `leader/`: it runs no election (it reads the controller's key to refuse a past term's intents,
        # libs/common/terms.py); a write there could depose every controller with a key bound to no lease
        return [read_all, KeyRange(prefix + "dcm/", write=True)]
    if role == "agent":
        return [read_all, KeyRange(f"{prefix}nodes/{node}", write=True, prefix=False),
                KeyRange(f"{prefix}agents/{node}/", write=True), KeyRange(f"{prefix}engines/{node}/", write=True)]
    return [read_all, KeyRange(f"{prefix}allocations/{node}/", write=True), KeyRange(f"{prefix}gpus/{node}/", write=True)]
