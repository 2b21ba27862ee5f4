"""`DeadlinePass`: the leader's level-triggered pass, every `tick_s`: what no message will bring is found here.

Each tick, for the incidents nobody is working on (their lock free, no background step of theirs running):
- a waiting state (freezing, reattaching, fallback) past its deadline: `deadline_missed`;
- opened or routing_in for over a second (a step that stalled, a resumed record): resumed;
- a fallback whose cold engine the view shows ready (its ready event missed, or sent before the spawn was
  answered): routed in;
- an incident opened in etcd by any instance's API that this leader does not hold: resumed (it dispatches it);
- the ends whose write or publication failed (endings.py, doubts): read back once etcd answers, each under its
  incident's lock; one read refused ends that tick's read-back (etcd still failing);
- the active engines of a node gone from the view (lost_nodes.py): probed at their endpoints, and those that do
  not answer faulted (`node_lost`), as their agent, gone with its node, cannot.
Each of these runs as a named background task, kept referenced until it ends, and is not handed out again while it
runs; `cancel` ends them when the term does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from libs.common.etcd_batch import BatchWriter
from libs.common.events import EngineInfo, EngineRole, Envelope, engine_record_key
from services.controller import engine_probe
from services.controller.bus_outages import BusOutages
from services.controller.endings import IncidentEnds
from services.controller.engine_stops import EngineStops
from services.controller.incident import (
    WAITING,
    Deadlines,
    IncidentRecord,
    IncidentState,
    Trigger,
    incident_id_for,
)
from services.controller.incident_locks import IncidentLocks
from services.controller.intake import cold_ready
from services.controller.lost_nodes import LIVE_STATES, LostNodes, lost_fault
from services.controller.moves import Move, Outcomes
from services.controller.open_incidents import OpenIncidents
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.deadlines")
S = IncidentState
STALLED_S = 1.0  # opened or routing_in for this long with nobody working on it: resumed
PING_EVERY_S = 0.2  # the bus asked this often whether it answers (a PING: the server's PONG)
PING_TIMEOUT_S = 0.5  # a PONG later than this is no answer


class Steps(Protocol):
    """What the pass hands its findings to (the driver, pipeline.py): a batch of one, a resume."""

    async def move_one(self, move: Move) -> None: ...

    async def resume(self, inc_id: str) -> None: ...

    async def on_faults(self, envs: list[Envelope]) -> Outcomes: ...


class DeadlinePass:
    def __init__(self, steps: Steps, open_: OpenIncidents, locks: IncidentLocks, view: ClusterView,
                 ends: IncidentEnds, tick_s: float, holds: Callable[[], bool] | None = None, *,
                 lost: LostNodes | None = None, probe_timeout_s: float = 2.0, source: str = "controller",
                 writer: BatchWriter | None = None, stops: EngineStops | None = None,
                 bus_ping: Callable[[], Awaitable[bool]] | None = None,
                 deadlines: Deadlines | None = None) -> None:
        self.steps = steps
        self.deadlines = deadlines or Deadlines()  # each state's budget: when its step began (its deadline less it)
        self.bus_ping = bus_ping  # a PING answered by this controller's NATS server (None: the bus always answers)
        self.answered_at = time.time()  # its last PONG
        self.outages = BusOutages()  # a step's deadline counts only the time the bus was up (bus_outages.py)
        self.writer = writer  # the term's fenced writer: a lost engine replaced is recorded failed through it
        self.stops = stops  # and stopped through these once its node is back (lost_nodes.py invariant 5)
        self.lost = lost if lost is not None else LostNodes(0.0)
        self.probe_timeout_s = probe_timeout_s
        self.source = source  # the lost-node faults' envelopes name this controller
        self.holds = holds  # the term's lease confirmed right now (pipeline.Tenure); None: always
        self.open = open_
        self.locks = locks
        self.view = view
        self.ends = ends
        self.tick_s = tick_s
        self._busy: set[str] = set()  # incidents a background task of this pass is working on
        self._tasks: set[asyncio.Task[None]] = set()
        self._settling: asyncio.Task[None] | None = None  # the read-back of doubtful ends

    async def run(self) -> None:
        if self.bus_ping is not None:
            self._spawn(self._ping_bus(self.bus_ping), "deadlines:bus-ping")
        while True:
            await asyncio.sleep(self.tick_s)
            self.tick(time.time())

    async def _ping_bus(self, ping: Callable[[], Awaitable[bool]]) -> None:
        while True:
            if await ping():  # no PONG (disconnected, the server stalled): the outage counts
                self.answered_at = time.time()
            await asyncio.sleep(PING_EVERY_S)

    def tick(self, now: float) -> None:
        self.outages.observe(now, now if self.bus_ping is None else self.answered_at)
        if self.holds is not None and not self.holds():
            # Not known to lead at this moment (resumed from a stop past the lease, etcd unreachable): a deadline
            # found missed in this table may be one a successor has long dealt with. Acted on once confirmed.
            return
        self.locks.forget_ended(self.open)
        if self.ends.doubts and (self._settling is None or self._settling.done()):
            self._settling = self._spawn(self._settle_ends(), "incident-ends:settle")
        for rec in self.open.records():
            if rec.id in self._busy or self.locks.held(rec.id):
                continue  # being worked on right now: nothing stalled
            if rec.state in WAITING and rec.deadline is not None and now > rec.deadline and not self.outages.down \
                    and now - self.outages.down_within(self._step_began(rec), now) > rec.deadline:
                self._background(rec.id, self.steps.move_one(Move(0, rec.id, Trigger.DEADLINE_MISSED,
                                                                  detail=f"{rec.state.value} missed its deadline")))
            elif rec.state in (S.OPENED, S.ROUTING_IN) and now - rec.updated_at > STALLED_S:
                self._background(rec.id, self.steps.resume(rec.id))
            elif rec.state is S.FALLBACK and rec.cold_successor_id:
                cold = self.view.engines.get(rec.cold_successor_id)
                if cold is not None and cold.state == "ready":
                    self._background(rec.id, self.steps.move_one(cold_ready(rec.id, cold)))
        for inc_id in list(self.view.open_by_engine.values()):
            seen = self.view.incidents.get(inc_id)
            if inc_id not in self.open and inc_id not in self._busy and not self.open.closed_here(inc_id) \
                    and seen is not None and seen.state is S.OPENED:
                self._background(inc_id, self.steps.resume(inc_id))
        off = self.view.engines_off_nodes()
        suspects = self.lost.suspects(now, self.view.nodes, off, self._handled)
        if suspects:
            self._spawn(self._declare_lost(suspects), "lost-nodes:probe")
        if self.writer is not None:
            for e in self.lost.ghosts(self.view.nodes, off, self._replaced):
                raw = {**(self.view.engine_raw.get(e.engine_id) or e.model_dump(mode="json")), "state": "failed"}
                self.writer.put_nowait(engine_record_key(e.node, e.engine_id), raw)
                log.info("engine %s of lost node %s: replaced; its record now says failed", e.engine_id, e.node)
        if self.stops is not None:
            for e in self.lost.returned(self.view.nodes, self.view.engines.get, self._replaced):
                log.info("node %s is back: its engine %s, replaced while it was lost, is stopped", e.node, e.engine_id)
                self.stops.stop(incident_id_for(e.engine_id, e.generation), e.engine_id, e.node)

    def _step_began(self, rec: IncidentRecord) -> float:
        """When the incident entered its state: its deadline less the state's budget (an update since, such as a
        step's record landing after the bus came back, moves `updated_at` and not the step's start)."""
        limit = self.deadlines.for_state(rec.state)
        return rec.updated_at if limit is None or rec.deadline is None else rec.deadline - limit

    def _replaced(self, e: EngineInfo) -> bool:
        return self.view.replaced_generation.get(e.engine_id, -1) >= e.generation

    def _handled(self, e: EngineInfo) -> bool:
        """Whether an incident took `e`'s generation up already: opened or ended, or the generation replaced since."""
        inc_id = incident_id_for(e.engine_id, e.generation)
        return (inc_id in self.open or self.open.closed_here(inc_id) or inc_id in self.view.incidents
                or self.view.gone_generation.get(e.engine_id, -1) >= e.generation)

    async def _declare_lost(self, suspects: list[EngineInfo]) -> None:
        """Probe each suspect's endpoint (lost_nodes.py, invariant 2); fault those that do not answer as
        themselves and whose node is still gone, their record unchanged, together."""
        try:
            reached = await engine_probe.answering([(e.endpoint or "", e.engine_id) for e in suspects],
                                                   self.probe_timeout_s)
        except Exception:  # noqa: BLE001 - asked again after `after_s`
            log.exception("probing a lost node's engines failed")
            reached = [True] * len(suspects)
        now = time.time()
        lost = []
        for e, up in zip(suspects, reached, strict=True):
            if self.lost.answered(e, up or not self._still_lost(e)):
                lost.append(e)
            elif up:
                log.info("node %s is gone from the view, but its engine %s answers: left to its agent", e.node,
                         e.engine_id)
        if not lost:
            return
        envs = [lost_fault(e, now - self.lost.gone_since.get(e.node, now), self.source) for e in lost]
        for e in lost:
            log.warning("engine %s: node %s gone and the engine does not answer: faulted as lost with it",
                        e.engine_id, e.node)
        try:
            out: Outcomes = await self.steps.on_faults(envs)
        except Exception as failed:  # noqa: BLE001 - every one declared again on a later tick
            out = [failed] * len(envs)
        for e, err in zip(lost, out, strict=True):
            if err is not None:  # its incident not opened: declared again on a later tick
                self.lost.declared.discard((e.engine_id, e.generation))
                log.warning("engine %s of lost node %s: its incident did not open (%r)", e.engine_id, e.node, err)

    def _still_lost(self, e: EngineInfo) -> bool:
        """After the probe: its node still gone, its record still that active generation (invariant 2)."""
        current = self.view.engines.get(e.engine_id)
        return (e.node not in self.view.nodes and current is not None and current.generation == e.generation
                and current.role is EngineRole.ACTIVE and current.state in LIVE_STATES)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _background(self, inc_id: str, coro: Coroutine[Any, Any, None]) -> None:
        self._busy.add(inc_id)

        async def run() -> None:
            try:
                await coro
            except Exception:  # noqa: BLE001 - retried on the next tick
                log.exception("incident %s: background step failed", inc_id)
            finally:
                self._busy.discard(inc_id)

        self._spawn(run(), f"incident:{inc_id}")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)  # referenced until done; cancelled by `cancel`
        task.add_done_callback(self._tasks.discard)
        return task

    async def _settle_ends(self) -> None:
        for inc_id in list(self.ends.doubts):
            try:
                async with self.locks.holding([inc_id]):
                    rec = await self.ends.settle(inc_id)
                    if rec is not None and inc_id not in self.open:
                        self.open.put(rec)  # its end never landed: resumed from etcd's record (the next ticks)
            except Exception as e:  # noqa: BLE001 - etcd still failing: read back on a later tick
                log.info("incident ends not settled yet (%r): again on the next tick", e)
                return
