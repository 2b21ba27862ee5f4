"""The engine's link to its node agent: registration, heartbeats, readiness, fatal errors, assignments.

Synchronous and thread-based (an engine has no event loop); no PyTorch dependency.

    link = AgentLink.connect()              # engine id, role, model... from the HF_* env the agent set
    link.start_heartbeats(0.2)              # from a thread of its own: a busy engine is not declared hung
    link.ready(endpoint="http://127.0.0.1:9000")
    a = link.wait_assignment()              # standby only: blocks until the agent assigns a predecessor
    # or, for a standby that can shadow (`shadows=True`), instructions until the assignment:
    ins = link.wait_instruction()           # Shadow(owner, share_token) | Unshadow() | Assignment
    link.shadowing(owner)                   # reported once the shadow is mapped and warm (None: dropped)
    link.report_fatal("cuda_error", "illegal address")   # then exit

The link survives an agent restart: its thread reconnects and registers again with what it last said
(role, ready, endpoint) and the assignment it was sent (`assigned`: its incident and predecessor), so the new agent
knows the engine without asking it anything, and a takeover its previous life began on this standby is resumed, not
begun again on it as if it still stood by.

Wire protocol (frames of `libs.common.wire`, msgpack maps with an "op"):
engine -> agent: register (first frame; answered by registered or error; `death_mark`: the frame carries the
engine's death mark, libs/common/death_mark.py; `shadows`: it can shadow, and whom it shadows now; `followers`: a
tensor-parallel group's rank 0 names its other ranks' processes, [{rank, pid, pid_start}], which the agent then
watches itself; `assigned`: {incident_id, predecessor} of the assignment that made it a successor), heartbeat, ready,
fatal, shadowing {owner, read_only}, asleep {sleeping}, bye;
agent -> engine: ack {seq}, assign {predecessor, transfer_token, incident_id, model, shadowed},
shadow {owner, share_token}, unshadow, owner_down {owner} (the shadowed engine failed: an assignment may follow),
error {code, message}.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.common import wire
from libs.common.death_mark import DeathMark, Unsupported
from libs.common.errors import HoldfastError, RemoteError, Unavailable
from libs.common.events import RankProcess
from libs.common.gc_tuning import long_lived_gc
from libs.common.ids import new_id

log = logging.getLogger("holdfast.agent_link")

PROTOCOL = 1


@dataclass(frozen=True)
class Assignment:
    predecessor: str
    transfer_token: str
    incident_id: str | None
    model: str
    gang: str | None = None  # a standby group's: the frozen gang its ranks take over, and the gang's generation
    gang_generation: int | None = None
    degraded: bool = False  # a spare group's: the gang's KV backups (frozen degraded), not its leases


@dataclass(frozen=True)
class Shadow:
    """Map `owner`'s weights read-only and warm up over them, so that a takeover of `owner` is instant."""

    owner: str
    share_token: str


@dataclass(frozen=True)
class Unshadow:
    """Drop the shadow (its owner went away without this standby taking over)."""


@dataclass(frozen=True)
class OwnerDown:
    """The shadowed engine failed (the agent published its fault): the assignment to take it over may follow.
    Nothing is owned or served on this word alone."""

    owner: str


Instruction = Assignment | Shadow | Unshadow | OwnerDown


def default_socket_path() -> str:
    if os.environ.get("HF_AGENT_SOCKET"):
        return os.environ["HF_AGENT_SOCKET"]
    base = os.environ.get("HF_STATE_DIR") or str(Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"holdfast-{os.getuid()}")
    return str(Path(base) / "agent.sock")


class AgentLink:
    def __init__(self, engine_id: str, socket_path: str, role: str, model: str, *, engine_class: str,
                 gpu: int, version: str, can_shadow: bool = False, fences: bool = False,
                 followers: Sequence[RankProcess] = (), spare: bool = False) -> None:
        self.engine_id = engine_id
        self.spare = spare  # a spare (EngineSpec.spares): an agent that does not know this engine adopts it as one
        self.followers = list(followers)  # a TP group's rank 0: its other ranks, told on every registration
        self.can_shadow = can_shadow
        self.fences = fences  # a standby that takes over through a fenced grant: assign it with the kill
        self.shadows: str | None = None
        self.shadow_read_only = False
        self.socket_path = socket_path
        self.role = role
        self.model = model
        self.engine_class = engine_class
        self.gpu = gpu
        self.version = version
        self.state = "starting"  # starting, ready, standby, assigned
        self.endpoint: str | None = None
        # The assignment that made this standby a successor ({incident_id, predecessor}), from the moment it arrives
        # (before the engine takes it from the queue): every registration repeats it
        self.assigned: dict[str, str] | None = None
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._assignments: queue.Queue[Instruction] = queue.Queue()
        self._acks: dict[int, threading.Event] = {}
        self._seq = 0
        self._hb_interval: float | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.reconnects = 0
        self._heap_frozen = False
        self.death_mark: DeathMark | None = None  # sent with every registration (libs/common/death_mark.py)

    # ------------------------------------------------------------ public API

    @classmethod
    def connect(cls, engine_id: str | None = None, *, socket_path: str | None = None, role: str | None = None,
                model: str | None = None, timeout: float = 10.0, can_shadow: bool = False,
                fences: bool = False, followers: Sequence[RankProcess] = ()) -> AgentLink:
        """Connect and register (retrying up to `timeout` while the agent's socket is not there yet). `fences`: a
        standby that, assigned, asks the gpu_manager for a fenced takeover (protocol.TakeoverReq) and touches the
        leases only after its predecessor's exit, so the agent may assign it without waiting for that exit.
        `followers`: a tensor-parallel group's rank 0 names the processes of its ranks 1..N-1 (their pids and start
        times), so that the agent sees a follower's death through a pidfd of its own; re-sent on every
        re-registration, so an agent restarted meanwhile watches them again."""
        env = os.environ
        link = cls(
            engine_id or env.get("HF_ENGINE_ID") or new_id("eng"),
            socket_path or default_socket_path(),
            role or env.get("HF_ENGINE_ROLE", "active"),
            model or env.get("HF_MODEL", "unknown"),
            engine_class=env.get("HF_ENGINE_CLASS", "default"),
            gpu=int(env.get("HF_GPU", "0")),
            version=env.get("HF_ENGINE_VERSION", "1"),
            can_shadow=can_shadow,
            fences=fences,
            followers=followers,
            spare=env.get("HF_ENGINE_SPARE", "") in ("1", "true"),  # the agent's (services/agent/starts.py)
        )
        try:  # on the caller's thread, which must be the main one (death_mark.py rule 3)
            link.death_mark = DeathMark.create()
        except (Unsupported, OSError) as e:
            log.info("no death mark (the agent polls for this engine's exit): %s", e)
        deadline = time.monotonic() + timeout
        while True:
            try:
                link._sock = link._register()
                break
            except RemoteError as e:  # the agent answered: only a full socket is worth a retry (its slots free up)
                if e.remote_code != "too_many_connections" or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
            except (OSError, wire.PeerClosed) as e:
                if time.monotonic() > deadline:
                    raise Unavailable(f"agent at {link.socket_path} unreachable: {e}") from None
                time.sleep(0.05)
        link._thread = threading.Thread(target=link._run, name="agent-link", daemon=True)
        link._thread.start()
        return link

    def start_heartbeats(self, interval_s: float = 0.2) -> None:
        """Heartbeat every `interval_s` from the link's thread; the first one goes now, from the caller, so
        the agent watches this engine for hangs from this moment on (not from the thread's next tick)."""
        self._hb_interval = interval_s
        try:
            self._send({"op": "heartbeat"})
        except (OSError, HoldfastError):
            pass  # reconnecting: the re-registration says heartbeats are on

    def ready(self, endpoint: str | None = None, *, weights: dict[str, Any] | None = None, kv: str | None = None,
              timeout: float = 5.0) -> None:
        """Serving (active) or warmed up (standby). Remembered: re-sent on every re-registration.

        A standby's warm-up ends here: its garbage is collected, and what is left (imports, warm-up state:
        it lives as long as the process) is moved out of the collector's sight (`long_lived_gc`: `gc.freeze`), so that a full
        collection of a large heap (torch) does not land inside the takeover that follows. Before the agent
        hears "ready", so that no assignment waits for it.

        `weights`: how a cold start loaded its weights (safetensors_io.WeightsLoad.report: source, load_ms), for
        the engine's record and its incident's timeline. `kv`: where a successor's KV came from when not the
        handed-on cache (a host backup's restore), likewise."""
        if self.role == "standby" and not self._heap_frozen:
            self._heap_frozen = True
            long_lived_gc()
        self.endpoint = endpoint
        self.state = "standby" if self.role == "standby" else "ready"
        msg: dict[str, Any] = {"op": "ready", "endpoint": endpoint, "state": self.state, "heartbeats": self._hb_interval is not None}
        if weights is not None:
            msg["weights"] = weights
        if kv is not None:
            msg["kv"] = kv
        self._request(msg, timeout)

    def asleep(self, sleeping: bool, *, timeout: float = 5.0) -> None:
        """Tell the agent this engine's memory is given back (sleep) or back (wake): a standby shadowing it drops
        its mapping, which would keep the memory alive."""
        self._request({"op": "asleep", "sleeping": sleeping}, timeout)

    def report_fatal(self, kind: str = "cuda_error", detail: str = "", *, timeout: float = 2.0) -> None:
        """Tell the agent this engine is failing; returns once the agent has it (or after `timeout`)."""
        self._request({"op": "fatal", "kind": kind, "detail": detail[:2000]}, timeout)

    def wait_assignment(self, timeout: float | None = None) -> Assignment:
        """Block until the agent assigns this standby a predecessor; it becomes the active engine.
        (An engine connected without `can_shadow` is never sent anything else.)"""
        while True:
            ins = self.wait_instruction(timeout)
            if isinstance(ins, Assignment):
                return ins

    def wait_instruction(self, timeout: float | None = None) -> Instruction:
        """The agent's next instruction to this standby; after an Assignment it is the active engine."""
        try:
            ins = self._assignments.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no instruction in {timeout}s") from None
        if isinstance(ins, Assignment):
            self.role = "active"
            self.state = "assigned"
        return ins

    def shadowing(self, owner: str | None, *, read_only: bool = False, timeout: float = 5.0) -> None:
        """Tell the agent whom this standby now shadows (None: nobody). Remembered across re-registrations."""
        self.shadows, self.shadow_read_only = owner, read_only
        self._request({"op": "shadowing", "owner": owner, "read_only": read_only}, timeout)

    def close(self) -> None:
        """Say goodbye (the agent then knows a following exit is this engine's own) and stop the thread."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._send({"op": "bye"})
        except (OSError, HoldfastError):
            pass
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> AgentLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _hello(self) -> dict[str, Any]:
        hello = {"op": "register", "protocol": PROTOCOL, "engine_id": self.engine_id, "pid": os.getpid(),
                 "role": self.role, "model": self.model, "engine_class": self.engine_class, "gpu": self.gpu,
                 "version": self.version, "state": self.state, "endpoint": self.endpoint,
                 "heartbeats": self._hb_interval is not None, "can_shadow": self.can_shadow, "shadows": self.shadows,
                 "fences": self.fences}
        if self.followers:  # only a group's rank 0 sends it (an agent that predates it ignores the key)
            hello["followers"] = [f.model_dump() for f in self.followers]
        if self.spare:  # only a spare sends it
            hello["spare"] = True
        if self.assigned is not None:  # only a successor sends it (an agent that predates it ignores the key)
            hello["assigned"] = dict(self.assigned)
        if self.death_mark is not None:  # its fd travels with the frame
            hello["death_mark"] = True
        return hello

    def _register(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(5.0)
            with wire.unix_address(self.socket_path) as address:
                sock.connect(address)
            wire.send_frame(sock, self._hello(), [self.death_mark.fd] if self.death_mark is not None else ())
            reply, fds = wire.recv_frame(sock)
            wire.close_fds(fds)
            if reply.get("op") == "error":
                raise RemoteError(str(reply.get("code")), str(reply.get("message")))
            if reply.get("op") != "registered":
                raise RemoteError("malformed", f"unexpected reply to register: {reply.get('op')!r}")
            sock.settimeout(None)
            return sock
        except BaseException:
            sock.close()
            raise

    def _send(self, msg: dict[str, Any]) -> None:
        sock = self._sock
        if sock is None:
            raise Unavailable("not connected to the agent")
        with self._send_lock:
            wire.send_frame(sock, msg)

    def _request(self, msg: dict[str, Any], timeout: float) -> bool:
        with self._send_lock:
            self._seq += 1
            seq = self._seq
        done = threading.Event()
        self._acks[seq] = done
        try:
            try:
                self._send({**msg, "seq": seq})
            except (OSError, HoldfastError):
                # Reconnecting: the state travels with the next registration; a fatal report does not.
                log.warning("agent link down while sending %s", msg["op"])
            return done.wait(timeout)
        finally:
            self._acks.pop(seq, None)

    def _run(self) -> None:
        next_hb = time.monotonic()
        while not self._closed.is_set():
            sock = self._sock
            if sock is None:
                try:
                    self._sock = self._register()
                    self.reconnects += 1
                    log.info("re-registered with the agent at %s", self.socket_path)
                except (OSError, HoldfastError):
                    self._closed.wait(0.05)
                continue
            now = time.monotonic()
            if self._hb_interval is not None and now >= next_hb:
                try:
                    self._send({"op": "heartbeat"})
                except OSError:
                    self._drop(sock)
                    continue
                next_hb = now + self._hb_interval
            wait = max(0.0, next_hb - time.monotonic()) if self._hb_interval is not None else 0.1
            try:
                readable, _, _ = select.select([sock], [], [], min(wait, 0.1))
                if readable:
                    msg, fds = wire.recv_frame(sock)
                    wire.close_fds(fds)
                    self._dispatch(msg)
            except (OSError, wire.PeerClosed, HoldfastError, ValueError):
                self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        if self._closed.is_set():
            return
        log.warning("agent link lost; reconnecting")
        if self._sock is sock:
            self._sock = None
        sock.close()

    def _dispatch(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "ack":
            ev = self._acks.get(int(msg.get("seq", -1)))
            if ev is not None:
                ev.set()
        elif op == "assign":
            if msg.get("incident_id"):  # said from now on, even before the engine takes the assignment from the queue
                self.assigned = {"incident_id": str(msg["incident_id"]), "predecessor": str(msg["predecessor"])}
            self._assignments.put(Assignment(
                predecessor=str(msg["predecessor"]), transfer_token=str(msg["transfer_token"]),
                incident_id=msg.get("incident_id"), model=str(msg.get("model") or self.model),
                gang=msg.get("gang"), degraded=bool(msg.get("degraded")),
                gang_generation=None if msg.get("gang_generation") is None else int(msg["gang_generation"])))
        elif op == "shadow" and self.can_shadow:
            self._assignments.put(Shadow(owner=str(msg["owner"]), share_token=str(msg["share_token"])))
        elif op == "unshadow" and self.can_shadow:
            self._assignments.put(Unshadow())
        elif op == "owner_down" and self.can_shadow:
            self._assignments.put(OwnerDown(owner=str(msg["owner"])))
        elif op == "error":
            log.error("agent says: %s: %s", msg.get("code"), msg.get("message"))
