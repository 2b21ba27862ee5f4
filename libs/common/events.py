"""The event and command catalog (DESIGN.md section 4): every message that crosses NATS, typed and versioned.

An `Envelope` wraps each payload: id, type, version, time, source, node, incident id and W3C trace context.
A payload's `type` names its subject: `incident.opened` travels on `<prefix>.incident.opened`; an event a node's
services publish (`NODE_EVENTS`) also names the node: `<prefix>.fault.detected.<node>`.
Commands travel on `<prefix>.node.<node>.<service>.<op>` as request/reply; each has its reply model.

Decoding validates the whole message; anything unknown or malformed raises `MalformedMessage` with a
message that says what was wrong, so a subscriber can log it and keep serving. On the wire (libs/common/bus/codec.py)
a field a model fills in by itself may be absent: a null, a payload's field at its default; an event's payload
always names its `type`. The models read that form and the one with every field written out alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from libs.common.errors import MalformedMessage
from libs.common.ids import new_id

SCHEMA_VERSION = 1
M = TypeVar("M", bound=BaseModel)


class Model(BaseModel):
    # Every string bounded (an identifier tighter: `Name`): a node's events and the records made of them are stored
    # in etcd, whose requests and replies are bounded, and one oversized field once failed the controller's batched
    # writes and every later term's reads (probe of 2026-12-06: a schema-valid fault with a 600 KB model name).
    # Every number finite: a command whose `expires` was NaN never expired (every comparison with NaN is false).
    model_config = ConfigDict(extra="forbid", frozen=True, str_max_length=4096, allow_inf_nan=False)


# An identifier (an engine, model, class, node, gang): part of etcd keys and of every record that names it.
Name = Annotated[str, Field(max_length=256)]


# ---------------------------------------------------------------- shared vocabulary


class FaultKind(StrEnum):
    EXITED = "exited"  # exited on its own (any exit code, including 0 when not asked to stop)
    KILLED = "killed"  # ended by a signal
    HUNG = "hung"  # heartbeats missing past the timeout
    CUDA_ERROR = "cuda_error"  # the engine reported a fatal CUDA error
    GPU_FAULT = "gpu_fault"  # NVML: XID or uncorrectable ECC on its GPU
    NODE_LOST = "node_lost"  # its node gone (no agent left to tell) and it does not answer: the leader's finding

    @property
    def loses_memory(self) -> bool:
        """Whether a fault of this kind takes the engine's leased memory with it (its successor starts cold):
        a GPU fault or its node's loss does; an engine that died on a sound GPU leaves its memory for the
        gpu_manager to freeze."""
        return self in _LOSES_MEMORY


_LOSES_MEMORY = frozenset({FaultKind.GPU_FAULT, FaultKind.NODE_LOST})


# The lease an engine keeps its KV cache's host backup in (engines/batched/backup.py: tag `other`, host memory): its
# cache's loss is not its recovery's while it and the weights live (services/controller/intake.py).
KV_BACKUP_LEASE = "kv_backup"


def is_kv_backup(name: str) -> bool:
    """A KV backup lease's name: `kv_backup`, or a tensor-parallel rank's (`kv_backup.tp2-r1`: each rank backs up
    its own shard, its lease named as libs/client/safetensors_io.py `shard_lease_name` names a rank's weights)."""
    return name == KV_BACKUP_LEASE or name.startswith(KV_BACKUP_LEASE + ".tp")


def holds_kv_backup(lease: LeaseInfo) -> bool:
    """A KV backup lease in host memory, which no GPU fault takes: what a successor that loads its weights itself
    continues from (Freeze `backups_only`)."""
    return lease.host and is_kv_backup(lease.name)


class LeaseState(StrEnum):
    ACTIVE = "ACTIVE"
    ORPHANED = "ORPHANED"
    FROZEN = "FROZEN"
    SLEEPING = "SLEEPING"  # the owner lives; its physical memory is released, its addresses kept (issue 21)
    RECLAIMED = "RECLAIMED"


class Tag(StrEnum):
    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    OTHER = "other"


class Step(StrEnum):
    DETECT = "detect"
    FREEZE = "freeze"
    ROUTE_OUT = "route_out"
    REATTACH = "reattach"
    ROUTE_IN = "route_in"
    FALLBACK = "fallback"


class IncidentReason(StrEnum):
    FAILURE = "failure"
    MANUAL_FAILOVER = "manual_failover"
    HOT_UPGRADE = "hot_upgrade"
    # a degraded engine (fewer ranks than its spec: a group that lost a GPU) replaced by a whole group from its KV
    # backup once the GPUs are there again (services/dc_manager/steps.py `_regroup`)
    REGROUP = "regroup"


class EngineRole(StrEnum):
    ACTIVE = "active"
    STANDBY = "standby"


class LeaseInfo(Model):
    """A lease as the gpu_manager reports it (one row of its table)."""

    id: str
    node: str
    gpu: int
    size: int
    chunk_size: int
    tag: Tag
    name: str = ""
    owner: str
    engine_class: str = "default"
    epoch: int
    state: LeaseState
    created_at: float
    last_seen: float
    deadline: float | None = None
    layout_hash: str | None = None
    # Host memory (a memfd) whatever the node's backend: not on the GPU it names, whose fault does not take it (a
    # KV cache's host backup, engines/batched/backup.py).
    host: bool = False
    # The incident it was last frozen for, and the owner a successor took it over from: a freeze of that owner for
    # that incident, sent after the takeover, is answered with the handover (gpu_manager commands.py).
    frozen_for: str | None = None
    handed_from: str | None = None
    # A sleeping weights lease: the root hash of the copy it wakes from (its bytes and tensors: any copy of that
    # root serves, whichever lease it was written from; one of another root never replaces it meanwhile).
    wake_copy: str | None = None


class EngineSpec(Model):
    """What the agent needs to run an engine (config or a spawn command)."""

    engine_class: str = "reference"
    model: str
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    # Each GPU by UUID ("GPU-8f3a...", stable across reboots and CUDA_VISIBLE_DEVICES) or by node-local index;
    # the agent resolves them against its node's GPUs and spreads the replicas over them (docs/multi_gpu.md).
    gpus: list[int | str] = Field(default_factory=lambda: list[int | str]([0]))
    replicas: int = 1
    standbys: int = 1
    cold_start_s: float = 30.0
    version: str = "1"
    # Tensor-parallel ranks (engines/reference `--tp`): the agent starts rank 0 with HF_ENGINE_TP and supervises the
    # ranks as one group, on GPUs gpu..gpu+tp-1 (docs/multi_gpu.md). Such a spec runs no standbys (not built).
    tp: int = Field(1, ge=1, le=64)
    # A group's GPUs, rank by rank (rank r on rank_gpus[r]), where they are not consecutive: a degraded group on
    # the GPUs a failed one left (engines/batched/degrade.py). Empty: base..base+tp-1 from `gpus`.
    rank_gpus: list[int | str] = Field(default_factory=list)
    # A group that lost a GPU's memory, with every rank's KV backup held (`--kv-backup`): continued by fewer ranks on
    # the GPUs left (engines/batched/degrade.py) only when no whole group can be placed ("no_whole_group": a whole
    # group serves faster but starts cold, every sequence prefilled again), at once ("first": no cold load, every
    # sequence kept; for a model whose load takes minutes), or never (a cold whole group, or nothing).
    degrade: Literal["no_whole_group", "first", "never"] = "no_whole_group"
    # Spares (docs/multi_gpu.md, "Spares"): standbys (a TP spec: standby groups) on the spec's other GPUs, each with
    # its own copy of the weights and its own KV cache, leased at its start, for a GPU fault: the engine's successor
    # is a spare on healthy GPUs, which takes its KV backups over (`--kv-backup`) and serves at once instead of a cold
    # start. For a class that builds them (the batched engine); GPUs of the spec without an active replica of it.
    spares: int = Field(0, ge=0, le=16)

    @model_validator(mode="after")
    def _one_gpu_a_rank(self) -> EngineSpec:
        if self.rank_gpus and (len(self.rank_gpus) != self.tp or len(set(self.rank_gpus)) != self.tp):
            raise ValueError(f"rank_gpus {self.rank_gpus} must name {self.tp} distinct GPUs, one a rank")
        return self


def engine_gpus(gpu: int, tp: int, rank_gpus: Sequence[int]) -> list[int]:
    """The GPUs an engine runs on: a group's rank r on `gpu + r`, or on `rank_gpus[r]` where the group names them."""
    return list(rank_gpus) or list(range(gpu, gpu + tp))


def rank_engine_id(engine_id: str, rank: int) -> str:
    """Rank r's engine id (its gpu_manager client) in the TP group whose rank 0 is `engine_id`."""
    return engine_id if rank == 0 else f"{engine_id}-r{rank}"


def group_of_rank(engine_id: str) -> str | None:
    """The rank 0 engine id a rank r > 0 would belong to (`rank_engine_id`'s inverse); None: not a rank's id shape.
    Only a shape: the caller checks the group's record lists it among its `ranks`."""
    group, sep, rank = engine_id.rpartition("-r")
    return group if sep and group and rank.isdigit() and int(rank) > 0 else None


class RankProcess(Model):
    """A follower rank's process (rank r > 0) of a tensor-parallel group, as its rank 0 reports it to the node's agent
    (the link's `register`, libs/client/agent_link.py): the agent watches it through a pidfd of its own, so that its
    death is the group's fault at once (services/agent/rank_watch.py). A pid with its start time (/proc/<pid>/stat
    field 22, clock ticks since boot) names one process forever: a recycled pid has another start time."""

    rank: int = Field(ge=1)
    pid: int = Field(gt=0)
    pid_start: int | None = None  # None: unknown (the agent then reads it as it opens its pidfd)


class WeightsLoaded(Model):
    """How a cold-started engine got its weights (issues 21, 22): a peer lease on the node (another engine's live
    copy of the same content), the node's host tier copy, its artifact, or the file."""

    source: Literal["peer", "host", "artifact", "file"]
    load_ms: float = Field(ge=0)
    refused: str = ""  # why a copy there was not used (corrupt, another layout); "" when none was refused
    # a tensor-parallel group: each rank's source, in rank order (`source` is then the slowest, `load_ms` the longest)
    ranks: list[Literal["peer", "host", "artifact", "file"]] = Field(default_factory=list)
    peer: str = ""  # source peer: which lease on which GPU ("lease-x on GPU 1"), as the gpu_manager's reply said
    spare: bool = False  # loaded by a spare at its start, before the fault it stood by for (EngineSpec.spares)

    def describe(self) -> str:
        """One line for an incident's timeline."""
        why = f" (copy refused: {self.refused})" if self.refused else ""
        where: str = self.source + (f" ({self.peer})" if self.peer else "")
        if self.ranks and len(set(self.ranks)) == 1:
            where = f"{self.source} ({len(self.ranks)} ranks)"
        elif self.ranks:
            where = ", ".join(f"{s} (rank {i})" for i, s in enumerate(self.ranks))
        if self.spare:
            return f"weights of a spare, loaded before the fault (from {where} in {self.load_ms:.1f} ms{why})"
        return f"weights from {where} in {self.load_ms:.1f} ms{why}"


class EngineInfo(Model):
    engine_id: Name
    node: Name
    model: Name
    engine_class: Name
    role: EngineRole
    pid: int | None = None
    gpu: int = 0  # the node-local index (what leases and placement key on)
    gpu_uuid: str | None = None  # the same GPU by UUID (None: an engine recorded before UUIDs, or adopted)
    endpoint: str | None = None
    generation: int = 0
    version: str = "1"
    state: str = "starting"  # starting, ready, standby, failed, stopped
    pid_start: int | None = None  # /proc/<pid>/stat start time (clock ticks): guards re-adoption against pid reuse
    spec_key: str | None = None  # which agent spec this engine belongs to (None: adopted, started by others)
    started_at: float | None = None
    heartbeats: bool = False  # the engine heartbeats: a restarted agent watches it for hangs from the start
    shadows: str | None = None  # a warm standby: the active engine whose weights it keeps mapped read-only
    # a successor: the engine whose leases it took over (or, a shadow promoted early, will own once that engine is
    # dead); if it dies before owning them they are still that engine's, frozen (the dc_manager hands them on)
    successor_of: str | None = None
    # A tensor-parallel group (this record is rank 0's, the one endpoint): its ranks' engine ids (rank_engine_id,
    # rank 0 first) and the gang of their leases (its id stays the first group's across successor groups).
    tp: int = 1
    ranks: list[str] = Field(default_factory=list)
    rank_gpus: list[int] = Field(default_factory=list)  # rank r's GPU where not gpu + r (EngineSpec.rank_gpus)
    gang: str | None = None
    # its follower ranks' processes (rank 0 reports them): a restarted agent watches them again from here
    followers: list[RankProcess] = Field(default_factory=list)
    weights: WeightsLoaded | None = None  # a cold start's load, as the engine reported it when ready
    kv: str | None = None  # where a successor's KV came from when not the handed-on cache ("KV from host backup: ...")
    spare: bool = False  # a standby on another GPU with its own weights, for a GPU fault (EngineSpec.spares)

    @property
    def gpus(self) -> list[int]:
        return engine_gpus(self.gpu, self.tp, self.rank_gpus)


def engine_record_key(node: str, engine_id: str) -> str:
    """An engine's record in etcd (EngineInfo, written by its node's agent): keyed by node so that etcd's RBAC
    lets a node's agent write its own engines' records and no other node's (security/policy.py)."""
    return f"engines/{node}/{engine_id}"


class NodeInfo(Model):
    """`nodes/<node>` in etcd, bound to the agent's etcd lease: it vanishes with a dead agent."""

    node: str
    datacenter: str = ""
    agent_pid: int
    agent_socket: str = ""
    started_at: float
    gpus: list[int] = Field(default_factory=list)
    nvml: bool = False


class GpuRecord(Model):
    """`gpus/<node>/<gpu>` in etcd, written by the node's gpu_manager: what placement reads (free bytes, health)."""

    node: str
    gpu: int  # node-local index (the key's last part)
    uuid: str | None = None
    total_bytes: int | None = None  # the most bytes leases may hold on it (None: unknown)
    leased_bytes: int = 0  # held by live leases (ACTIVE, ORPHANED, FROZEN)
    leases: int = 0
    healthy: bool = True
    detail: str = ""  # why it is unhealthy (XID 79, ECC, fallen off the bus, marked by an operator)
    simulated: bool = False  # the host backend's stand-in for a GPU (a share of host memory)
    updated_at: float = 0.0
    # weight copies on this node (the same for each of its GPUs): name -> "peer" (a live lease of another engine with
    # the same content: a copy GPU to GPU, issue 22), "host" (a host tier copy, restored at PCIe speed) or
    # "artifact" (on disk); placement prefers a node holding one, the closest first (issue 21)
    copies: dict[str, str] = Field(default_factory=dict)
    # the GPUs of this node it reaches over NVLink (NVML's P2P status; the host backend's from config `gpu_links`):
    # placement puts a tensor-parallel group's ranks on GPUs that all reach each other first
    links: list[int] = Field(default_factory=list)


# ---------------------------------------------------------------- events (durable, on the JetStream stream)


class Event(Model):
    """Base of every event payload. Subclasses set `type` as a Literal."""

    durable: ClassVar[bool] = True


class FaultDetected(Event):
    type: Literal["fault.detected"] = "fault.detected"
    engine_id: Name
    model: Name = ""
    engine_class: Name = "default"
    generation: int = 0
    pid: int | None = None
    kind: FaultKind
    exit_code: int | None = None
    signal: int | None = None
    gpu: int = 0
    gpu_uuid: Name | None = None
    died_at: float | None = Field(None, description="when the agent observed the death (epoch seconds)")
    detail: str = ""
    role: EngineRole | None = None  # a standby's fault costs no memory: the agent replaces it by itself
    node: Name = ""
    # A rank of a tensor-parallel group: the group's rank 0 engine id (the incident is the group's: one per group
    # and generation, whichever rank faults) and its gang. None: a single engine.
    group: Name | None = None
    gang: Name | None = None
    # Which rank of the group died first, when the agent saw a follower (1..N-1) die before rank 0 (its watch of the
    # follower's own process); None: rank 0, a single engine, or a fault not of one rank (a hang, a CUDA error).
    rank: int | None = None


class IncidentOpened(Event):
    type: Literal["incident.opened"] = "incident.opened"
    incident_id: str
    engine_id: str
    reason: IncidentReason
    kind: FaultKind | None = None
    model: str = ""
    gpu: int = 0


class IncidentStep(Event):
    type: Literal["incident.step"] = "incident.step"
    incident_id: str
    step: Step
    status: Literal["started", "done", "failed", "skipped"]
    at: float = Field(default_factory=time.time)
    detail: str = ""


class IncidentResolved(Event):
    type: Literal["incident.resolved"] = "incident.resolved"
    incident_id: str
    engine_id: str
    successor_id: str | None = None
    timings_ms: dict[str, float] = Field(default_factory=dict)
    total_ms: float = 0.0
    fallback: bool = False


class IncidentFailed(Event):
    type: Literal["incident.failed"] = "incident.failed"
    incident_id: str
    engine_id: str
    step: Step
    reason: str


class RecoverIntent(Event):
    """controller -> dc_manager: get this engine's memory serving again."""

    type: Literal["intent.recover"] = "intent.recover"
    incident_id: str
    engine_id: str
    model: str
    engine_class: str = "default"
    gpu: int = 0
    reason: IncidentReason = IncidentReason.FAILURE
    kind: FaultKind | None = None
    memory_lost: bool = False  # gpu fault or lease gone: go straight to the cold-start fallback
    version: str | None = None  # hot upgrade: the successor's engine version
    node: str | None = None  # the node the engine ran on (dc_manager routes and places by it)
    successor: str | None = None  # a named standby to take over (manual failover may name one)
    gang: str | None = None  # a tensor-parallel group: its gang is frozen (FreezeGang) and taken over whole
    # The sending controller's leader term (LeaderElection.term): the dc_manager runs the intent only while that term
    # leads (services/dc_manager/terms.py). 0: not stamped (an older controller, a tool): not checked.
    term: int = Field(0, ge=0)


class IntentResult(Event):
    """dc_manager -> controller: how one step of an intent went."""

    type: Literal["intent.result"] = "intent.result"
    incident_id: str
    step: Step
    ok: bool
    detail: str = ""
    successor_id: str | None = None
    endpoint: str | None = None
    timings_ms: dict[str, float] = Field(default_factory=dict)
    node: str | None = None  # where the successor runs (the controller stops a superseded cold start there)
    # When the freeze this result follows was answered (epoch seconds): a prompt takeover's result is the
    # intent's only one, and the controller ends the freeze step at this time (not at the result's arrival).
    frozen_at: float | None = None
    kv: str = ""  # a reattach: where its successor's KV came from when not the handed-on cache (EngineInfo.kv)


class MemoryFrozen(Event):
    type: Literal["memory.frozen"] = "memory.frozen"
    owner: str
    lease_ids: list[str]
    epoch: int
    incident_id: str | None = None


class LeaseChanged(Event):
    type: Literal["memory.lease.changed"] = "memory.lease.changed"
    lease: LeaseInfo
    from_state: LeaseState | None
    cause: str = ""


class EngineStarted(Event):
    type: Literal["engine.started"] = "engine.started"
    engine: EngineInfo


class EngineReady(Event):
    type: Literal["engine.ready"] = "engine.ready"
    engine: EngineInfo
    takeover_of: str | None = None  # a successor taking over this engine's memory: its incident routes it in


class EngineStopped(Event):
    """An engine the agent was asked to stop has stopped (not a fault)."""

    type: Literal["engine.stopped"] = "engine.stopped"
    engine_id: str
    exit_code: int | None = None


class EngineReattached(Event):
    type: Literal["engine.reattached"] = "engine.reattached"
    incident_id: str | None
    predecessor_id: str
    engine: EngineInfo
    used_standby: bool
    timings_ms: dict[str, float] = Field(default_factory=dict)


class EndpointAdded(Event):
    type: Literal["router.endpoint.added"] = "router.endpoint.added"
    model: str
    engine_id: str
    url: str
    incident_id: str | None = None
    predecessor_id: str | None = None  # routers replay the predecessor's in-flight requests here


class EndpointRemoved(Event):
    type: Literal["router.endpoint.removed"] = "router.endpoint.removed"
    model: str
    engine_id: str
    url: str | None = None
    reason: str = ""
    incident_id: str | None = None
    # The warm standby that will most likely take over (one that shadows this engine: its agent picks it first):
    # routers may send it this engine's resumed and new requests at once; it holds them until it serves, so the
    # requests' way to it overlaps the takeover. Its `endpoint.added` confirms it; another successor's revokes it.
    successor_id: str | None = None
    successor_url: str | None = None
    # An incident's route-out: it brings a successor in (routed in by `endpoint.added` with this incident_id) or
    # ends without one (`endpoint.unrecovered`); meanwhile routers hold the model's requests past their own hold.
    recovery: bool = False
    # The engine is sound and serves on until its agent stops it (a planned incident: a manual failover, a hot
    # upgrade, a regroup): routers take no new request to it but leave its streams running until it stops or its
    # successor is routed in (`endpoint.added` naming it) or the recovery ends. Cut at once, its streams' aborts
    # would drop their sequences from its journal and KV backup before the freeze, and its successor would prefill
    # them again (services/router/sync.py).
    live: bool = False


class EndpointNotRecovered(Event):
    """The incident that removed this engine's endpoint (EndpointRemoved.incident_id) ended without routing a
    successor in: routers stop holding the model's requests for that recovery (they held them past their own hold
    while it ran: services/router/table.py, invariant 2)."""

    type: Literal["router.endpoint.unrecovered"] = "router.endpoint.unrecovered"
    model: str
    engine_id: str
    incident_id: str
    reason: str = ""


class EndpointStandby(Event):
    """The warm standby that shadows a routed engine, its likely successor (the one `EndpointRemoved.successor_url`
    will name): routers open spare connections to it before any failure (services/router/spare.py), so that a
    failover's resumed and new requests find them open instead of connecting in the failover's busiest moment. Sent
    when it changes and again now and then (a router started later learns it); routers forget one not sent again."""

    type: Literal["router.endpoint.standby"] = "router.endpoint.standby"
    model: str
    engine_id: str
    standby_id: str
    standby_url: str


class GpuHealth(Event):
    """A GPU's health changed (or its gpu_manager started): the same fields as its `gpus/<node>/<gpu>` record."""

    type: Literal["node.gpu.health"] = "node.gpu.health"
    gpu: int
    healthy: bool
    detail: str = ""
    node: str = ""
    uuid: str | None = None
    total_bytes: int | None = None
    leased_bytes: int = 0
    lost_leases: list[str] = Field(default_factory=list)  # leases reclaimed because this GPU failed


AnyEvent = Annotated[
    Union[  # noqa: UP007 - a discriminated union needs the typing form
        FaultDetected,
        IncidentOpened,
        IncidentStep,
        IncidentResolved,
        IncidentFailed,
        RecoverIntent,
        IntentResult,
        MemoryFrozen,
        LeaseChanged,
        EngineStarted,
        EngineReady,
        EngineStopped,
        EngineReattached,
        EndpointAdded,
        EndpointRemoved,
        EndpointNotRecovered,
        EndpointStandby,
        GpuHealth,
    ],
    Field(discriminator="type"),
]

EVENT_TYPES: dict[str, type[Event]] = {
    m.model_fields["type"].default: m for m in AnyEvent.__origin__.__args__  # type: ignore[attr-defined]
}


# ---------------------------------------------------------------- commands (request/reply, not durable)


class Command(Model):
    """Base of every command. `service` and `op` name its subject: <prefix>.node.<node>.<service>.<op>."""

    service: ClassVar[str]


class Freeze(Command):
    service: ClassVar[str] = "gpu_manager"
    op: Literal["freeze"] = "freeze"
    owner: str
    incident_id: str | None = None
    # Chosen by the caller, so that a shadowing successor can be promoted while the freeze runs (it needs the
    # token only to own the leases later); leases already frozen keep theirs, and the reply says which holds.
    transfer_token: str | None = Field(None, min_length=16, max_length=128)
    # only the owner's committed KV backups (host memory), for a cold successor that loads the weights itself and
    # restores the cache from them (its weights and cache lost with their GPU); its other leases are left as they are
    backups_only: bool = False
    # The node's agent promoting its own standby under this token (services/agent/takeover.py `promote`): the only
    # taker of the incident's leases (the control plane's takeover joins its), so its token replaces the one of a
    # freeze for the same incident that came first (the dc_manager's: nobody holds that one)
    promotion: bool = False


class FreezeReply(Model):
    lease_ids: list[str]
    epoch: int
    transfer_token: str
    leases: list[LeaseInfo] = Field(default_factory=list)
    # the node's GPUs the gpu_manager holds unhealthy as it froze (index -> why): newer than any view of etcd
    unhealthy_gpus: dict[int, str] = Field(default_factory=dict)
    # The leases were frozen for this incident and taken over already, by this successor (the node's agent froze
    # them and promoted its standby itself, services/agent/takeover.py `promote`): `leases` are the successor's now, and the
    # token is spent (`transfer_token` is the one this freeze asked for, or a new one nobody holds).
    handed_to: str | None = None


class Transfer(Command):
    service: ClassVar[str] = "gpu_manager"
    op: Literal["transfer"] = "transfer"
    owner: str  # the frozen owner whose leases move
    successor: str
    transfer_token: str
    incident_id: str | None = None


class TransferReply(Model):
    lease_ids: list[str]
    epoch: int


class Reclaim(Command):
    service: ClassVar[str] = "gpu_manager"
    op: Literal["reclaim"] = "reclaim"
    lease_id: str
    force: bool = False


class ReclaimReply(Model):
    lease: LeaseInfo


class Thaw(Command):
    """The leases frozen for `incident_id` back to their owners, who serve on: an incident begun on purpose (a manual
    failover, an upgrade) failed before anyone took them over or stopped their engine (the controller's
    `serves_on`). All of them or none: refused while any owner's process is gone (those wait for their deadline)."""

    service: ClassVar[str] = "gpu_manager"
    op: Literal["thaw"] = "thaw"
    incident_id: str = Field(min_length=1, max_length=256)


class ThawReply(Model):
    lease_ids: list[str]  # thawed by this command (none: thawed already, taken over, or never frozen for it)


class FreezeGang(Command):
    """Freeze every lease of every rank of a tensor-parallel engine's gang under one transfer token, or none
    (services/gpu_manager/gangs.py): refused `partial_gang` / `stale_gang` when a rank's leases are missing or moved."""

    service: ClassVar[str] = "gpu_manager"
    op: Literal["freeze_gang"] = "freeze_gang"
    gang_id: str
    incident_id: str | None = None
    transfer_token: str | None = Field(None, min_length=16, max_length=128)
    # only every rank's KV backup, for a degraded group (a gang that lost a rank's GPU memory; gang.py invariant 10)
    degraded: bool = False


class FreezeGangReply(Model):
    gang_id: str
    owners: list[str]  # rank r's engine id
    generation: int  # what the successor group names in its gang_takeover
    transfer_token: str
    leases: list[LeaseInfo] = Field(default_factory=list)
    # the node's GPUs the gpu_manager holds unhealthy as it froze (index -> why): newer than any view of etcd
    unhealthy_gpus: dict[int, str] = Field(default_factory=dict)


class ReclaimGang(Command):
    """Reclaim every lease of a gang at once (an ACTIVE one only with `force`), or none."""

    service: ClassVar[str] = "gpu_manager"
    op: Literal["reclaim_gang"] = "reclaim_gang"
    gang_id: str
    force: bool = False
    # Only if the gang is still this group's (its rank 0's engine id): a gang id outlives its groups, so a clean-up
    # meant for a lost group never takes a successor group's memory (`conflict` then). None: whoever holds it.
    group: str | None = None
    incident_id: str | None = None


class ReclaimGangReply(Model):
    lease_ids: list[str]


class ShareWeights(Command):
    """A read-only share of an owner's weight leases for a warm standby of the same model (its shadow).

    The reply's token lets only `grantee` (same uid as the owner) map those leases read-only through the
    engine socket. Nothing changes hands: the owner keeps them, and the grantee still needs the transfer
    token of a freeze to own them."""

    service: ClassVar[str] = "gpu_manager"
    op: Literal["share"] = "share"
    owner: str
    grantee: str


class ShareWeightsReply(Model):
    share_token: str
    lease_ids: list[str]
    bytes: int


class SetGpuHealth(Command):
    """Mark one of the node's GPUs healthy or not (the agent on an NVML fault, or an operator). Unhealthy: every
    live lease on it is reclaimed (cause `gpu_fault`: its memory is lost) and new allocations there are refused
    until it is marked healthy again."""

    service: ClassVar[str] = "gpu_manager"
    op: Literal["gpu_health"] = "gpu_health"
    gpu: int | str  # index or UUID
    healthy: bool
    detail: str = ""


class SetGpuHealthReply(Model):
    gpu: GpuRecord
    lost_leases: list[str] = Field(default_factory=list)


class ListLeases(Command):
    service: ClassVar[str] = "gpu_manager"
    op: Literal["list"] = "list"
    owner: str | None = None
    state: LeaseState | None = None


class ListLeasesReply(Model):
    leases: list[LeaseInfo]


class SnapshotLease(Command):
    """Write a committed lease's bytes, tensors and hashes to a weight artifact on its node (issue 21), and with
    `host_tier` keep a copy in the node's host memory too. Answered when the artifact is whole on disk."""

    service: ClassVar[str] = "gpu_manager"
    op: Literal["snapshot"] = "snapshot"
    lease_id: str
    artifact: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    host_tier: bool = False


class SnapshotReply(Model):
    artifact: str  # the name a restore asks for
    path: str
    bytes: int
    seconds: float
    gib_s: float
    root_hash: str
    direct_io: bool
    host_tier: bool = False  # a host-tier copy is held too
    tier_registered: bool = False  # cuda: that copy page-locked in place now, so its restores are DMA only
    tier_register_s: float = 0.0  # the registering's seconds, apart from `seconds` (the copy's)


class SleepEngine(Command):
    """Ask an engine (through its gpu_manager, on its next heartbeat) to quiesce and release its KV cache's
    physical memory, keeping its addresses; level 2 releases its weights too (kept by a node copy). `wake`
    maps new memory at the same addresses (and restores the weights). Answered once the engine did it."""

    service: ClassVar[str] = "gpu_manager"
    op: Literal["sleep_engine"] = "sleep_engine"
    engine_id: str = Field(min_length=1, max_length=256)
    level: int = Field(1, ge=1, le=2)
    wake: bool = False  # True: wake it (level is ignored)
    timeout_s: float = Field(60.0, gt=0, le=3600)


class SleepEngineReply(Model):
    engine_id: str
    state: str  # "sleeping" or "awake"
    level: int
    lease_ids: list[str]
    bytes: int  # physical bytes released (sleep) or mapped again (wake)
    seconds: float  # from the ask to the engine's answer
    free_bytes_before: int | None = None  # the device's free memory (cuda: cuMemGetInfo), None on the host backend
    free_bytes_after: int | None = None
    weights_source: str | None = None  # wake of level 2: which copy restored the weights (host, artifact)


class Takeover(Command):
    service: ClassVar[str] = "agent"
    op: Literal["takeover"] = "takeover"
    incident_id: str
    engine_id: str  # the failed (or to-be-replaced) engine
    transfer_token: str
    successor: str | None = None  # a named standby; none: the agent picks one, or cold-spawns
    version: str | None = None  # hot upgrade: run a standby of this version
    # whose frozen leases the successor takes over, when not `engine_id`'s: its predecessor's, which `engine_id` (a
    # shadow promoted early) died before owning
    memory_of: str | None = None
    # A tensor-parallel group's frozen gang: a successor group is started that takes it over whole
    # (HF_TAKEOVER_GANG, HF_GANG_GENERATION with the transfer token); no standby.
    gang: str | None = None
    gang_generation: int | None = None


class TakeoverReply(Model):
    engine: EngineInfo
    used_standby: bool
    timings_ms: dict[str, float] = Field(default_factory=dict)


class Spawn(Command):
    service: ClassVar[str] = "agent"
    op: Literal["spawn"] = "spawn"
    spec: EngineSpec
    engine_id: str | None = None
    incident_id: str | None = None
    reattach_from: str | None = None  # cold-spawn a process that reattaches this engine's leases
    transfer_token: str | None = None
    # A degraded successor (engines/batched/degrade.py): one engine that takes over this broken gang's KV backups
    # (frozen degraded under `transfer_token`, at `gang_generation`), in place of the group `predecessor`.
    degrade_gang: str | None = None
    gang_generation: int | None = Field(None, ge=1)
    predecessor: str | None = None
    # A cold successor on the GPU its spec names that takes this engine's KV backup over (frozen `backups_only`
    # under `transfer_token`), loads the weights itself and restores every sequence from the backup.
    backup_of: str | None = None
    # The spare (EngineSpec.spares) that becomes this successor, its weights loaded already: it takes `backup_of`'s
    # KV backup over, or (none) starts serving afresh. Gone or failing: a cold engine is started instead.
    spare: str | None = None


class SpawnReply(Model):
    engine: EngineInfo


class StopEngine(Command):
    service: ClassVar[str] = "agent"
    op: Literal["stop"] = "stop"
    engine_id: str
    # The sending controller's leader term (LeaderElection.term): the agent stops the engine only while that term
    # leads (libs/common/terms.py). 0: not stamped (an operator, a tool): not checked.
    term: int = Field(0, ge=0)


class StopReply(Model):
    engine_id: str
    exit_code: int | None = None


class MarkGpu(Command):
    """An agent's GPU marked unhealthy (what an NVML XID or ECC event does; on the host backend the only way a
    simulated GPU fails) or healthy again. Unhealthy: every live engine on it gets one `gpu_fault` and is killed,
    the gpu_manager loses its leases, and no replica is placed on it until it is marked healthy."""

    service: ClassVar[str] = "agent"
    op: Literal["mark_gpu"] = "mark_gpu"
    gpu: int | str  # index or UUID
    healthy: bool = False
    detail: str = "marked unhealthy"


class MarkGpuReply(Model):
    gpu: int
    uuid: str | None = None
    healthy: bool
    engines: list[str] = Field(default_factory=list)  # engines faulted because of it
    gpu_manager: SetGpuHealthReply | None = None  # None: no answer within 5 s (the agent keeps sending it)


class ListEngines(Command):
    service: ClassVar[str] = "agent"
    op: Literal["list"] = "list"


class RestartBackoff(Model):
    """An agent's crash-loop backoff for one engine spec: engines of it failing soon after their start."""

    spec_key: str
    failures: int = 0  # consecutive failures of engines that did not stay up `reset_s`
    delay_s: float = 0.0  # how long the latest failure's replacement waits
    retry_in_s: float = 0.0  # from the reply's time until a replacement may start (0: may start now)


class ListEnginesReply(Model):
    engines: list[EngineInfo]
    backoff: list[RestartBackoff] = Field(default_factory=list)  # specs whose engines are crash-looping


class Health(Command):
    service: ClassVar[str] = "any"
    op: Literal["health"] = "health"


class HealthReply(Model):
    service: str
    instance: str
    ok: bool = True
    detail: dict[str, Any] = Field(default_factory=dict)


class ErrorBody(Model):
    code: str
    message: str


class Reply(Model):
    """Every reply: either `data` (the command's reply model, as a dict) or `error`."""

    ok: bool
    data: dict[str, Any] | None = None
    error: ErrorBody | None = None


# ---------------------------------------------------------------- envelope


class TraceContext(Model):
    traceparent: str | None = None
    tracestate: str | None = None


class Envelope(Model):
    # The W3C trace context travels here, not in a NATS header too (libs/common/bus: a subscriber's handler runs
    # under it). `node` and `incident_id` are sent even where the payload repeats them: readers take them from here
    # (the node is checked against the subject), and a reader of an older tree could only.
    id: str = Field(default_factory=new_id)
    type: str
    version: int = SCHEMA_VERSION
    time: float = Field(default_factory=time.time)
    source: str
    node: str | None = None
    incident_id: str | None = None
    trace: TraceContext = Field(default_factory=TraceContext)
    data: AnyEvent


class CommandEnvelope(Model):
    id: str = Field(default_factory=new_id)
    version: int = SCHEMA_VERSION
    time: float = Field(default_factory=time.time)
    source: str
    trace: TraceContext = Field(default_factory=TraceContext)
    to: str | None = None  # the node it is addressed to (its subject's); a service serving another refuses it
    # the sender's wall clock when its caller stops waiting for the answer; a receiver later than that (with a slack
    # for the clocks of two machines) refuses it: libs/common/bus/commands.py `EXPIRY_SLACK_S`
    expires: float | None = None
    data: dict[str, Any]


_envelope_adapter = TypeAdapter(Envelope)


def _summarize(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        loc = ".".join(str(p) for p in e["loc"])
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def decode_event(raw: bytes) -> Envelope:
    """Parse and validate an event; raise `MalformedMessage` saying what is wrong."""
    try:
        env = _envelope_adapter.validate_json(raw)
    except ValidationError as e:
        raise MalformedMessage(f"invalid event: {_summarize(e)}") from None
    if env.version > SCHEMA_VERSION:
        raise MalformedMessage(f"event version {env.version} is newer than {SCHEMA_VERSION}")
    if env.type != env.data.type:
        raise MalformedMessage(f"envelope type {env.type!r} does not match payload type {env.data.type!r}")
    return env


def decode_model(model: type[M], data: Any) -> M:
    """Validate `data` (dict or JSON bytes) as `model`, raising `MalformedMessage` on failure."""
    try:
        if isinstance(data, bytes | str):
            return model.model_validate_json(data)
        return model.model_validate(data)
    except ValidationError as e:
        raise MalformedMessage(f"invalid {model.__name__}: {_summarize(e)}") from None


def command_kind(command: type[Command] | Command) -> str:
    """'<service>.<op>': the end of a command's subject, the same on every node."""
    return f"{command.service}.{command.model_fields['op'].default}"


def command_subject(prefix: str, node: str, command: type[Command] | Command) -> str:
    return f"{prefix}.node.{node}.{command_kind(command)}"


# Events a node's own services (agent, gpu_manager) publish: each travels on a subject that ends with the node's
# name, and each node's identity may publish only on its own node's subjects (security/policy.py). Invariant: the
# envelope's `node` equals its subject's last token (a subscriber refuses any other: `Bus`, issue 20).
NODE_EVENTS: frozenset[type[Event]] = frozenset(
    {FaultDetected, MemoryFrozen, LeaseChanged, EngineStarted, EngineReady, EngineStopped, EngineReattached, GpuHealth})
NODE_EVENT_TYPES: frozenset[str] = frozenset(e.model_fields["type"].default for e in NODE_EVENTS)
ANY_NODE = "*"


def event_subject(prefix: str, event: Event | type[Event], node: str = ANY_NODE) -> str:
    """`<prefix>.<type>`, and for a node's event `<prefix>.<type>.<node>` (default: every node's, to subscribe)."""
    kind = event.model_fields["type"].default
    return f"{prefix}.{kind}.{node}" if kind in NODE_EVENT_TYPES else f"{prefix}.{kind}"


def subscription_subject(prefix: str, subject: str) -> str:
    """What to subscribe to for `subject` (with or without the prefix): a node event's type alone stands for every
    node's (`fault.detected` -> `<prefix>.fault.detected.*`); wildcards and full subjects are kept as they are."""
    full = subject if subject.startswith(prefix + ".") else f"{prefix}.{subject}"
    return f"{full}.{ANY_NODE}" if full[len(prefix) + 1:] in NODE_EVENT_TYPES else full


def subject_node(prefix: str, subject: str) -> str | None:
    """The node a node event's subject names (its last token), or None for any other subject."""
    kind, _, node = subject[len(prefix) + 1:].rpartition(".")
    return node if kind in NODE_EVENT_TYPES else None
