"""Engine records and their lifecycle as a transition table (pure: no I/O).

Invariants (README, numbered there):
- an engine's state changes only through `transition()`; an undefined move raises `InvalidTransition`;
- a record is `faulted` at most once (`FaultLatch`): one `FaultDetected` per engine generation, whatever
  else is observed afterwards (a hung engine later killed, a reported error followed by the exit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from libs.common.errors import InvalidTransition, MalformedMessage
from libs.common.events import EngineInfo, EngineRole, RankProcess, WeightsLoaded, engine_gpus, rank_engine_id


class State(StrEnum):
    STARTING = "starting"  # process started (or adopted), not ready yet
    READY = "ready"  # active and serving
    STANDBY = "standby"  # warmed up, waiting for an assignment
    ASSIGNED = "assigned"  # a standby told to take over; attaching
    FAILED = "failed"  # a fault was detected; waits for a takeover (or its replacement)
    STOPPING = "stopping"  # asked to stop by the agent
    STOPPED = "stopped"  # gone on purpose or after its fault was handled


class Ev(StrEnum):
    READY = "ready"
    ASSIGN = "assign"
    FAULT = "fault"
    STOP = "stop"
    GONE = "gone"


_T: dict[tuple[State, Ev], State] = {
    (State.STARTING, Ev.READY): State.READY,  # role picks READY or STANDBY, see transition()
    (State.STANDBY, Ev.READY): State.STANDBY,  # re-registration after an agent restart
    (State.READY, Ev.READY): State.READY,
    (State.STANDBY, Ev.ASSIGN): State.ASSIGNED,
    (State.ASSIGNED, Ev.READY): State.READY,
    (State.FAILED, Ev.STOP): State.FAILED,  # killing a failed engine does not make it healthy
    (State.FAILED, Ev.GONE): State.STOPPED,
    (State.STOPPING, Ev.GONE): State.STOPPED,
    (State.STOPPING, Ev.FAULT): State.STOPPING,  # dying while being stopped is not a fault
}
for _s in (State.STARTING, State.READY, State.STANDBY, State.ASSIGNED):
    _T[(_s, Ev.FAULT)] = State.FAILED
    _T[(_s, Ev.STOP)] = State.STOPPING
    _T[(_s, Ev.GONE)] = State.STOPPED
TRANSITIONS = dict(_T)

LIVE = frozenset({State.STARTING, State.READY, State.STANDBY, State.ASSIGNED})


@dataclass
class EngineRecord:
    engine_id: str
    model: str
    engine_class: str
    role: EngineRole
    gpu: int = 0
    version: str = "1"
    spec_key: str | None = None
    pid: int | None = None
    pid_start: int | None = None
    child: bool = False  # our own child: waitid gives the exit status
    generation: int = 0
    state: State = State.STARTING
    endpoint: str | None = None
    started_at: float = field(default_factory=time.time)
    spawned_mono: float = field(default_factory=time.monotonic)
    last_heartbeat: float | None = None  # monotonic; None: hang detection not armed yet
    linked: bool = False
    said_bye: bool = False
    faulted: bool = False
    failed_mono: float | None = None
    # No takeover can come for its memory: its fault loses it (FaultKind.loses_memory) or its incident has ended
    # (incident_ends.py). A failed active engine then keeps no slot: it is replaced at once (supervision.plan).
    memory_lost: bool = False
    # Its fault lost its memory (a GPU fault): it keeps its slot until then (monotonic) for the control plane's fallback
    # successor, which continues it from its KV backup or on a spare (supervision.awaits_fallback).
    fallback_until: float | None = None
    handing_over: bool = False  # a takeover's predecessor: its slot is the successor's until it is retired
    ready_perf: float | None = None  # perf_counter when it last said ready (takeover timings)
    taking_over: str | None = None  # the predecessor whose memory this successor takes over (until ready)
    # The incident whose takeover assigned this standby (takeover.py); after an agent's restart, as its registration
    # says (supervision.inherit_assignment): that takeover is resumed on it, never begun again
    assigned_for: str | None = None
    successor_of: str | None = None  # the engine whose leases it took over (EngineInfo.successor_of)
    exit_code: int | None = None
    signal: int | None = None
    can_shadow: bool = False  # a standby that can map an active engine's weights read-only ahead of a takeover
    shadows: str | None = None  # the active engine it shadows (it said so over its link)
    fences: bool = False  # a standby that waits for its predecessor's exit itself (fenced takeover): assigned with the kill
    shadow_offered: str | None = None  # a shadow instruction sent, not answered yet
    shadow_refused: set[str] = field(default_factory=set)  # engines it could not shadow (not offered again)
    asleep: bool = False  # its memory is given back (sleep/wake, as it said over its link): nobody shadows it
    tp: int = 1  # tensor-parallel ranks: this is rank 0's record, the group's (its process starts the others)
    rank_gpus: list[int] = field(default_factory=list)  # rank r's GPU where not gpu + r (EngineSpec.rank_gpus)
    gang: str | None = None  # a TP group's gang id (the first group's engine id, kept by its successor groups)
    followers: list[RankProcess] = field(default_factory=list)  # a TP group's ranks 1.., as rank 0 named them (rank_watch.py)
    weights: WeightsLoaded | None = None  # a cold start's load, as the engine said when ready (issue 21)
    kv: str | None = None  # where its KV came from when not the handed-on cache, as it said when ready (issue 22)
    spare: bool = False  # a standby on another GPU with its own weights (EngineSpec.spares), until it is assigned

    def transition(self, ev: Ev) -> State:
        nxt = TRANSITIONS.get((self.state, ev))
        if nxt is None:
            raise InvalidTransition(f"engine {self.engine_id}: {ev.value} is not allowed in state {self.state.value}")
        if self.state is State.STARTING and ev is Ev.READY and self.role is EngineRole.STANDBY:
            nxt = State.STANDBY
        self.state = nxt
        return nxt

    def latch_fault(self) -> bool:
        """True the first time only: the caller may publish this generation's one FaultDetected."""
        if self.faulted or self.state in (State.STOPPING, State.STOPPED):
            return False
        self.faulted = True
        return True

    @property
    def live(self) -> bool:
        return self.state in LIVE

    @property
    def gpus(self) -> list[int]:
        """The GPUs its ranks run on (rank r on gpu + r, or on rank_gpus[r])."""
        return engine_gpus(self.gpu, self.tp, self.rank_gpus)

    def info(self, node: str = "") -> EngineInfo:
        return EngineInfo(
            engine_id=self.engine_id, node=node, model=self.model, engine_class=self.engine_class, role=self.role,
            pid=self.pid, gpu=self.gpu, endpoint=self.endpoint, generation=self.generation, version=self.version,
            state=self.state.value, pid_start=self.pid_start, spec_key=self.spec_key, started_at=self.started_at,
            heartbeats=self.last_heartbeat is not None, shadows=self.shadows, successor_of=self.successor_of,
            tp=self.tp, gang=self.gang, weights=self.weights, kv=self.kv, followers=list(self.followers),
            ranks=[rank_engine_id(self.engine_id, r) for r in range(self.tp)] if self.tp > 1 else [],
            rank_gpus=list(self.rank_gpus), spare=self.spare,
        )

    @classmethod
    def from_info(cls, info: EngineInfo) -> EngineRecord:
        state = State(info.state) if info.state in State.__members__.values() else State.STARTING
        return cls(
            engine_id=info.engine_id, model=info.model, engine_class=info.engine_class, role=info.role,
            gpu=info.gpu, version=info.version, spec_key=info.spec_key, pid=info.pid, pid_start=info.pid_start,
            child=False, generation=info.generation, state=state, endpoint=info.endpoint,
            started_at=info.started_at or time.time(), faulted=state is State.FAILED, successor_of=info.successor_of,
            tp=info.tp, gang=info.gang, weights=info.weights, kv=info.kv, followers=list(info.followers),
            rank_gpus=list(info.rank_gpus), spare=info.spare,
            # A heartbeating engine must beat again (through its reconnected link) within the timeout.
            last_heartbeat=time.monotonic() if info.heartbeats else None,
        )



def weights_loaded(raw: Any) -> WeightsLoaded | None:
    """The `weights` of an engine's ready message (how its cold start loaded: source, load_ms, refused) as
    recorded; None when absent. Raises `MalformedMessage` for anything else."""
    if raw is None:
        return None
    try:
        peer = (raw.get("restore") or {}).get("peer") or {}
        return WeightsLoaded(source=raw["source"], load_ms=raw["load_ms"], refused=str(raw.get("refused", ""))[:500],
                             ranks=raw.get("ranks") or [],
                             peer=f"{peer['lease']} on GPU {peer['gpu']}" if peer else "", spare=bool(raw.get("spare")))
    except (ValidationError, KeyError, TypeError, AttributeError) as e:
        raise MalformedMessage(f"weights report {raw!r:.200}: {e}") from None
