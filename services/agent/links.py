"""The engines' links: one stream per registered engine (libs/client/agent_link.py, over link_server.py's socket),
what an engine's registration and frames do to its record, and what the agent sends it (a standby's assignment,
a shadow's offer, a shadow's `owner_down`).

Every registration and frame reaches here validated (protocol.py, at link_server.py's edge): a record holds only
what its `EngineInfo` can be built from. A registration's pid is the kernel's (SO_PEERCRED); an engine id held by a
live process cannot be claimed by another (invariant 5), and an engine declared failed is refused, never adopted
again: its slot is its successor's. An engine this agent does not know is adoption.py's.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Sequence
from typing import Any, Protocol

from libs.common.errors import Conflict, MalformedMessage, PermissionDenied
from libs.common.events import EngineReady, EngineRole, RankProcess
from libs.common.wire import FrameStream, close_fds
from services.agent import rank_watch, shadows, supervision
from services.agent.adoption import Adoption
from services.agent.engines import EngineRecord, Ev, State, weights_loaded
from services.agent.protocol import Asleep, Fatal, Heartbeat, LinkMessage, Ready, Register, Shadowing
from services.agent.table import EngineTable, FaultReporter

log = logging.getLogger("holdfast.agent")


class Host(EngineTable, FaultReporter, shadows.Agent, Protocol):
    """What the links need of the agent beyond its engine table and what shadows.py needs: adoption, faulting, a
    group's followers watched, the ready waiters and a reconcile pass."""

    adoption: Adoption

    def watch_followers(self, rec: EngineRecord, followers: list[RankProcess]) -> None: ...

    def resolve_ready(self, rec: EngineRecord, exc: BaseException | None = None) -> None: ...

    def reconcile_soon(self) -> None: ...

    def inherited(self, rec: EngineRecord) -> None: ...


class Links:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.streams: dict[str, FrameStream] = {}  # engine id -> its registered link
        self.registered: set[str] = set()  # engines that registered in this agent's life (links.py `assigned`)

    def on_register(self, reg: Register, stream: FrameStream, fds: Sequence[int] = ()) -> EngineRecord:
        """Register (or register again) the engine on `stream`; `fds` are closed here, the first armed as the
        engine's death mark where it says it sent one (`death_mark`) and the agent's `death_marks` are on."""
        fds = list(fds)
        try:
            rec = self._register(reg, stream)
            if fds and reg.death_mark and self.host.settings.marks_on():
                self._arm(rec, fds.pop(0))
            return rec
        finally:
            close_fds(fds)

    def _arm(self, rec: EngineRecord, fd: int) -> None:
        """The engine's death mark armed (pidfd.py); one that is not its is refused with a warning and its exit
        polled, as an engine's that sends none (libs/common/death_mark.py rule 2)."""
        try:
            self.host.watcher.arm(rec.engine_id, fd)
        except MalformedMessage as e:
            log.warning("engine %s: death mark refused (%s): its exit is polled", rec.engine_id, e)
        except KeyError:
            log.warning("engine %s: death mark sent before its process is watched: its exit is polled",
                        rec.engine_id)

    def _register(self, reg: Register, stream: FrameStream) -> EngineRecord:
        host = self.host
        creds = stream.peer_credentials()
        pid, engine_id = reg.pid, reg.engine_id
        if pid != creds.pid:
            raise PermissionDenied(f"claimed pid {pid} but the socket says {creds.pid}")
        rec = host.engines.get(engine_id)
        if rec is not None and rec.pid not in (None, pid) and host.watcher.watching(engine_id):
            raise Conflict(f"engine {engine_id} is already registered by pid {rec.pid}")
        if rec is not None and rec.state is State.FAILED and rec.pid == pid:
            # Declared failed (hung, say, slow to connect): its fault is published and its slot is a successor's;
            # adopting it again would run one engine more than the spec wants. It is killed when retired.
            raise Conflict(f"engine {engine_id} (pid {pid}) was declared failed: it is replaced, not registered")
        readopted = rec is not None and rec.live and engine_id not in self.registered  # first time this life
        if rec is None or not rec.live:
            rec = host.adoption.adopt(reg, pid)
        self.registered.add(engine_id)
        old = self.streams.pop(engine_id, None)
        if old is not None and old is not stream:
            hang_up(old)  # the same engine registering again: its newer connection wins
        self.streams[engine_id] = stream
        supervision.registered(rec, reg.heartbeats, time.monotonic())
        rec.can_shadow = reg.can_shadow
        rec.fences = reg.fences
        if reg.followers and rec.tp > 1:  # a TP group's rank 0 names its other ranks: watched from now on
            try:
                host.watch_followers(rec, rank_watch.parse_followers(reg.followers, rec.tp))
            except MalformedMessage as e:
                log.warning("engine %s: %s; its followers' deaths are seen through its exit", rec.engine_id, e)
        # A standby this agent's previous life assigned (it died before answering the takeover): what the engine says
        # wins over the record, which still says standby; its takeover is resumed (takeover.py `resume`), not begun
        # again on it as if it stood by (probe D2-frozen, 2026-12-07: it was, and was declared hung 15 s later).
        inherited = False
        if reg.assigned is not None and rec.state is State.STANDBY and rec.assigned_for != reg.assigned.incident_id:
            why = supervision.assignment_refused(rec, host.engines.get(reg.assigned.predecessor),
                                                 reg.assigned.incident_id, readopted)
            if why is None:
                inherited = supervision.inherit_assignment(rec, reg.assigned.incident_id, reg.assigned.predecessor,
                                                           reg.state)
            else:
                log.warning("engine %s says it was assigned %s for %s: not taken up (%s)", rec.engine_id,
                            reg.assigned.predecessor, reg.assigned.incident_id, why)
        if reg.shadows and rec.role is EngineRole.STANDBY:
            rec.shadows = reg.shadows  # re-registration: it still shadows that engine
        if reg.state in ("ready", "standby") and rec.state is State.STARTING:
            rec.endpoint = reg.endpoint
            rec.transition(Ev.READY)
            host.save(rec)
        if inherited:
            if rec.state is State.READY:
                rec.endpoint = reg.endpoint
            log.info("engine %s registers assigned %s for %s (%s) by this agent's previous life: its takeover resumes",
                     rec.engine_id, rec.taking_over, rec.assigned_for, rec.state.value)
            host.save(rec)
            host.inherited(rec)
        return rec

    def on_message(self, rec: EngineRecord, msg: LinkMessage) -> dict[str, Any] | None:
        """Handle one frame from an engine, validated (protocol.py); returns the reply (an ack) if it wants one."""
        host = self.host
        if isinstance(msg, Heartbeat):
            armed = rec.last_heartbeat is not None
            rec.last_heartbeat = time.monotonic()
            if not armed:
                host.save(rec)  # recorded, so that a restarted agent keeps watching it for hangs
            return None
        if isinstance(msg, Ready):
            self._ready(rec, msg)
        elif isinstance(msg, Fatal):
            host.fault(rec, msg.kind, detail=msg.detail, died_at=time.time())
        elif isinstance(msg, Shadowing):
            shadows.shadowing(host, rec, msg.owner or None)
        elif isinstance(msg, Asleep):  # its memory goes (or came back): its shadows are dropped (or offered again)
            rec.asleep = msg.sleeping
            host.background(shadows.reconcile(host), f"shadows:{rec.engine_id}")
        else:  # bye: a following exit is its own
            rec.said_bye = True
        return None if msg.seq is None else {"op": "ack", "seq": msg.seq}

    def _ready(self, rec: EngineRecord, msg: Ready) -> None:
        host = self.host
        if msg.heartbeats and rec.last_heartbeat is None:
            rec.last_heartbeat = time.monotonic()  # heartbeats are on: a hang from now on is detected
        rec.endpoint = msg.endpoint
        rec.kv = msg.kv
        try:
            rec.weights = weights_loaded(msg.weights)
        except MalformedMessage as e:  # the engine serves all the same; its timeline lacks the source
            log.warning("engine %s: %s", rec.engine_id, e)
        if rec.state in (State.STARTING, State.ASSIGNED, State.READY, State.STANDBY):
            rec.ready_perf = time.perf_counter()
            rec.transition(Ev.READY)
            # The waiter (a takeover's reply) first: it runs before the publish and the etcd write
            # queued below (the event loop runs callbacks in the order they were scheduled).
            host.resolve_ready(rec)
            host.publish(EngineReady(engine=host.info(rec), takeover_of=rec.taking_over))
            host.save(rec)
            host.reconcile_soon()  # a new standby, or a new engine to shadow

    def on_link_closed(self, rec: EngineRecord, stream: FrameStream) -> None:
        if self.streams.get(rec.engine_id) is stream:
            self.streams.pop(rec.engine_id, None)
            rec.linked = False

    async def assign(self, rec: EngineRecord, msg: dict[str, Any]) -> None:
        link = self.streams.get(rec.engine_id)
        if link is None:
            raise ConnectionError(f"standby {rec.engine_id} has no link")
        await link.send(msg)

    def owner_down(self, rec: EngineRecord) -> None:
        """A standby shadowing the failed engine hears of it now, not only when assigned (~6 ms later on an H200):
        it can start on the generations the engine had in flight (engines/reference/continuation.py)."""
        for sb in self.host.engines.values():
            if sb.shadows == rec.engine_id and sb.engine_id in self.streams:
                self.host.background(self.assign(sb, {"op": "owner_down", "owner": rec.engine_id}),
                                     f"owner-down:{sb.engine_id}")

    def drop(self, engine_id: str) -> None:
        """The engine's process is gone: its link is hung up."""
        link = self.streams.pop(engine_id, None)
        if link is not None:
            hang_up(link)

    def close(self) -> None:
        for link in list(self.streams.values()):
            link.close()


def hang_up(stream: FrameStream) -> None:
    """End a link that its handler (link_server.py) may be waiting on: shut down, not closed, so that the handler
    wakes to the end of the stream and ends, giving back its connection slot; the server closes the socket then.
    (Closed under it, the handler's wait on the fd never woke: its task and slot were held for good.)"""
    with contextlib.suppress(OSError):
        stream.sock.shutdown(socket.SHUT_RDWR)

