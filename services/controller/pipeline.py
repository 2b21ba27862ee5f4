"""`IncidentDriver`: the leader's side of the pipeline (detect -> freeze -> route out -> reattach -> route in).

One path per step, for any number of incidents: what the durable consumers deliver in one loop pass
(`Bus.durable_batches`) is handled together, and a single event (an engine or memory event, a deadline) is a
batch of one on the same path. Faults open their incidents (the creates awaited together); results and
events become `Move`s, triggers of `incident.py`'s table; then `_advance` runs the controller's own steps for
every incident the batch moved: the route-outs of those opened published with one `publish_all` (one wait
for their stream acks), the route-ins of those whose successor is known likewise. Each incident keeps its
own lock, record and derived event ids, and a failure fails (and redelivers) only the messages it concerns:
the per-message outcome is what the consumer acks or naks.

Every step is idempotent by recorded progress (the record in etcd says which entry actions are done,
invariant 3 of `incident.py`), and every event published has an id derived from the incident, so the
JetStream duplicate window drops a re-publication after a crash: a resumed incident finishes exactly once.
Order of work inside a step: act first, then record that the step is done (a crash in between redoes an
idempotent action instead of skipping one).

Durability (DESIGN.md section 4, latency budget): the opening is written and confirmed before the fault is
acked (it is what makes one incident per failed generation: a fault delivered again finds it); for the common
case, a routed engine's first fault, the route-out and dispatch go while that create is in flight
(`_dispatch_first`: its etcd commit, 2-8 ms, was on every failover's way to the successor), which is safe
because they are idempotent by the incident's id and the fault stays unacked until the create is confirmed.
Every later record, and the endpoint keys, are written behind through one fenced `BatchWriter` (grouped into
etcd transactions, guarded by the leader key). A queued record lost in a crash is redone by the next leader
from the older record, or, with none, from the fault delivered again.

The parts, one concern each: what a message means (`intake.py`), where a move takes a record (`moves.py`, pure),
the events built (`routes.py`), ends recorded then announced (`endings.py`), the open records and their indexes
(`open_incidents.py`), who works on an incident (`incident_locks.py`), the level-triggered pass
(`deadline_pass.py`), engines outside incidents (`engine_routes.py`), engines stopped (`engine_stops.py`), the
incident's trace (`incident_trace.py`). This module is the path that runs them, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from libs.common.bus import Bus, delivery_attempts, engines_on_their_nodes, server_answers
from libs.common.errors import Unavailable
from libs.common.etcd_batch import BatchWriter
from libs.common.events import EngineReady, EngineStopped, Envelope
from libs.common.store import Store
from services.controller.deadline_pass import PING_TIMEOUT_S, DeadlinePass
from services.controller.endings import IncidentEnds
from services.controller.engine_routes import EngineRoutes
from services.controller.engine_stops import EngineStops
from services.controller.incident import Deadlines, IncidentRecord, IncidentState, Trigger
from services.controller.incident_locks import IncidentLocks
from services.controller.incident_log import IncidentLog, ledger_key
from services.controller.incident_trace import IncidentTracer
from services.controller.intake import Intake, Opening, cold_ready, incident_of
from services.controller.lost_nodes import LostNodes
from services.controller.metrics import ControllerMetrics
from services.controller.moves import Move, Outcomes, next_record, result_moves
from services.controller.open_incidents import OpenIncidents
from services.controller.routes import IncidentEvents, serves_on, successor_serves
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView

log = logging.getLogger("holdfast.controller.pipeline")
S = IncidentState



class Tenure(Protocol):
    """The term's lease as the driver asks about it (`LeaderElection`): does this process still lead right now."""

    term: int  # the leader key's create revision while leading

    def holds(self) -> bool: ...

    async def confirm(self, within_s: float) -> bool: ...


class IncidentDriver:
    """Invariant: nothing is done for an incident (no event published, no command sent) unless the term's lease is
    confirmed at that moment (`Tenure.holds`), besides the writes' fence. A leader stopped past its lease (SIGSTOP,
    a paused VM) resumes with a table its successor has moved on from: its writes fail the fence, but its
    publications would not (a fallback's cold start beside the successor, a second end)."""

    def __init__(self, bus: Bus, store: Store, view: ClusterView, settings: ControllerSettings,
                 metrics: ControllerMetrics, fence: Callable[[Any], list[Any]], tenure: Tenure | None = None) -> None:
        self.bus = bus
        self.tenure = tenure  # None: always leading (tests that drive the pipeline without an election)
        self.store = store
        self.view = view
        self.settings = settings
        self.metrics = metrics
        # Fencing: every write (batched or not) holds only while this term's leader key exists
        # (LeaderElection.fence): not after the lease is lost, nor in a later term of this same process.
        self.writer = BatchWriter(store, guard=fence, behind_linger_s=settings.record_linger_s)
        self.subscriptions: list[Any] = []  # the term's durable consumers (unsubscribed when it ends)
        self.writer.on_send = view.expect_own  # the view takes our records back from the watch unparsed
        self.log = IncidentLog(store, self.writer)
        self.deadlines = Deadlines(settings.freeze_deadline_s, settings.reattach_deadline_s, settings.fallback_deadline_s)
        self.open = OpenIncidents()  # all incident state is in these records (incident.py's table)
        self.intake = Intake(view, self.open)
        self.tracing = IncidentTracer()
        # Intents carry the term this driver was made in (not the election's later one): a driver that outlived its
        # term sends its own, which the dc_manager refuses (services/dc_manager/terms.py).
        self.events = IncidentEvents(bus, view, self.writer, self.tracing, self.deadlines,
                                     term=tenure.term if tenure is not None else 0)
        self.stops = EngineStops(bus, view, term=self.events.term)  # stamped as the intents are (StopEngine.term)
        self.ends = IncidentEnds(bus, self.log, self.events, self.stops)
        self.engine_routes = EngineRoutes(bus, view, self.writer, self.events, self.open)
        self.locks = IncidentLocks()  # not incident state: who is working on an incident right now
        self.deadline_pass = DeadlinePass(self, self.open, self.locks, view, self.ends, settings.tick_s,
                                          holds=tenure.holds if tenure is not None else None,
                                          lost=LostNodes(settings.node_lost_s),
                                          probe_timeout_s=settings.node_probe_timeout_s, source=settings.instance,
                                          writer=self.writer, stops=self.stops,
                                          bus_ping=lambda: server_answers(bus.nc, PING_TIMEOUT_S),
                                          deadlines=self.deadlines)

    # ------------------------------------------------------------ lifecycle (leader only)

    async def start(self) -> None:
        """Announce the ends an earlier term recorded but did not announce, resume every open incident from its
        record, then consume events (redelivered ones included)."""
        open_, unannounced, spent = await self.log.to_take_over()
        await self.ends.take_over(unannounced)
        for ledger_id in spent:
            self.writer.delete_nowait(ledger_key(ledger_id))
        for rec in open_:
            self.open.put(rec)
        log.info("leader resumes %d open incident(s)", len(self.open))
        for inc_id in self.open:
            try:
                await self.resume(inc_id)
            except Exception:  # noqa: BLE001 - the deadline pass retries it
                log.exception("incident %s: resume failed", inc_id)
        kw: dict[str, Any] = {"concurrency": self.settings.concurrency, "ack_wait": self.settings.ack_wait_s}
        subs = self.subscriptions
        # A node's events may name only its own node's engines (a fault, a ready engine's endpoint, a stop).
        vet = engines_on_their_nodes(self.view.engines)
        subs.append(await self.bus.durable_batches("fault.detected", "controller-faults", self.on_faults, vet=vet,
                                                   **kw))
        # A result is filed under its incident's recorded trace: its message's context need not be made current.
        # It holds its slot a round trip longer than a fault (its end is written, then announced): more slots, so
        # that incidents end as fast as they open and none waits long enough for its waiting record to be written.
        subs.append(await self.bus.durable_batches("intent.result", "controller-intents", self.on_results,
                                                   **{**kw, "concurrency": self.settings.result_concurrency}))
        subs.append(await self.bus.durable("engine.>", "controller-engines", self.on_event, vet=vet, **kw))
        subs.append(await self.bus.durable("memory.>", "controller-memory", self.on_event, vet=vet, **kw))

    async def stop(self) -> None:
        """Step down: consume nothing more (unacked events go to the next leader), end the background steps,
        and send what is queued: against the fence of a lost term every write fails (its waiters hear it and
        their events are redelivered); on a clean stop while still leading they are written."""
        for sub in self.subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self.subscriptions.clear()
        self.deadline_pass.cancel()
        self.stops.cancel()
        try:
            await self.writer.flush()
        finally:
            await self.writer.close()

    async def leading(self) -> None:
        """Raise `Unavailable` (the messages concerned are redelivered, to whoever leads) unless the term's lease is
        confirmed; waits up to a ttl for the next refresh to confirm it (an etcd hiccup, a loop that was busy)."""
        if self.tenure is None or self.tenure.holds():
            return
        if not await self.tenure.confirm(float(self.settings.leader_ttl_s)):
            raise Unavailable("this controller's leader lease is not confirmed (lost, or etcd unreachable)")

    async def run_deadlines(self) -> None:
        """The level-triggered pass (deadline_pass.py), for as long as the term lasts."""
        await self.deadline_pass.run()

    # ------------------------------------------------------------ event handlers (batches; one event: a batch of one)

    async def on_faults(self, envs: list[Envelope]) -> Outcomes:
        """Faults delivered in one loop pass: each opens its incident (a redelivery finds it), or moves one already
        open (intake.py)."""
        out: Outcomes = [None] * len(envs)
        opens, moves = self.intake.faults(envs)
        async with self.locks.holding([*opens, *(m.inc_id for m in moves)]):
            await self.leading()
            moved, unconfirmed = await self._open(list(opens.values()), out)
            moved.update(await self._apply(moves, out))
            await self._advance(moved, out)
            await self._confirm(unconfirmed, out)
        return out

    async def on_results(self, envs: list[Envelope]) -> Outcomes:
        """Intent results delivered in one loop pass, each a trigger of its incident (moves.py)."""
        return await self._moved(result_moves(envs), len(envs))

    async def on_event(self, env: Envelope) -> None:
        """An engine or memory event: a move of its incident (a batch of one), or the route of an engine in none."""
        e = env.data
        move = self.intake.event_move(e)
        if move is not None:
            await self.move_one(move)
            return
        await self.leading()
        if isinstance(e, EngineReady):
            await self.engine_routes.ready(e)
        elif isinstance(e, EngineStopped):
            await self.engine_routes.stopped(e.engine_id)

    async def trigger(self, inc_id: str, trigger: Trigger, *, states: frozenset[IncidentState] | None = None,
                      detail: str = "", frozen_at: float | None = None, **changes: Any) -> None:
        """One trigger: a batch of one (`Move`)."""
        await self.move_one(Move(0, inc_id, trigger, states, detail, frozen_at, changes))

    async def move_one(self, move: Move) -> None:
        """A batch of one move; raises what failed it."""
        out = await self._moved([move], 1)
        if out[0] is not None:
            raise out[0]

    async def resume(self, inc_id: str) -> None:
        """Run the controller's own steps for an incident from its latest record (a new term, a stalled step)."""
        out: Outcomes = [None]
        async with self.locks.holding([inc_id]):
            await self.leading()
            rec = self.open.get(inc_id) or await self.log.load(inc_id)
            if rec is None or rec.terminal:
                self.open.drop(inc_id)
                return
            self.open.put(rec)
            await self._advance({inc_id: 0}, out)
        if out[0] is not None:
            raise out[0]

    # ------------------------------------------------------------ the path (its callers hold the incidents' locks)

    async def _moved(self, moves: list[Move], n: int) -> Outcomes:
        out: Outcomes = [None] * n
        async with self.locks.holding(m.inc_id for m in moves):
            await self.leading()
            await self._advance(await self._apply(moves, out), out)
        return out

    async def _open(self, faults: list[Opening],
                    out: Outcomes) -> tuple[dict[str, int], list[tuple[int, IncidentRecord, asyncio.Future[bool]]]]:
        """Each fault's incident, opened here (creates queued together, awaited together) or, found in etcd (a
        redelivery), loaded. Returns the incidents to advance, by id: the message each one came from; and those
        advanced before their create is confirmed (`_dispatch_first`), whose creates `_confirm` awaits."""
        found: dict[str, int] = {}
        created = []
        unconfirmed = []
        attempts = delivery_attempts.get()
        for i, f, env in faults:
            inc_id = incident_of(f)
            if inc_id in self.open:
                found[inc_id] = i
                continue
            try:
                rec = self.intake.record_from_fault(inc_id, f, env, self.settings.instance)
                self.tracing.open(rec)
            except Exception as e:  # noqa: BLE001 - this fault alone is redelivered
                out[i] = e
                continue
            created.append((i, rec, self.log.create_soon(rec)))  # create first: the common case is a new fault
        for i, rec, fut in created:
            if self._dispatch_first(rec, attempts[i] if i < len(attempts) else 0):
                self.open.put(rec)
                found[rec.id] = i
                unconfirmed.append((i, rec, fut))
                continue
            try:
                if await fut:
                    self._opened(rec)
                else:  # it exists (a redelivery): load it
                    loaded = await self.log.load(rec.id)
                    if loaded is None or loaded.terminal:
                        continue
                    rec = loaded
            except Exception as e:  # noqa: BLE001 - etcd failed this create or load: redelivered
                out[i] = e
                continue
            self.open.put(rec)
            found[rec.id] = i
        return found, unconfirmed

    def _opened(self, rec: IncidentRecord) -> None:
        """`rec`'s create confirmed: counted, its detect step's span (no copy made when none is exported), logged."""
        self.metrics.record_opened(rec)
        if self.tracing.export_spans:
            self.tracing.steps(rec.model_copy(update={"steps": {}}), rec)
        log.info("incident %s opened: %s %s", rec.id, rec.engine_id, rec.kind)

    def _dispatch_first(self, rec: IncidentRecord, attempt: int) -> bool:
        """Whether `rec`'s route-out and dispatch may go before its create is confirmed: a first delivery of the
        fault of an engine routed now (so no incident of that generation routed it out before, here or under an
        earlier leader), a single engine (a group's faults join one incident: that path stays in order) whose
        memory is not lost (a cold start takes seconds: its few ms are not worth a second order of steps). Its
        create is awaited right after (`_confirm`); the dispatch is idempotent by the incident's id (the event ids
        derive from it; the dc_manager and the agent act once per incident), so a leader that dies before the
        create lands leaves the fault unacked, and the next one opens and dispatches it again, as it resumes an
        incident from `opened`. This takes the opening's etcd commit off the way to the successor."""
        return (self.settings.dispatch_before_create and attempt == 1 and rec.gang is None and not rec.memory_lost
                and self.view.endpoint_of(rec.engine_id) is not None)

    async def _confirm(self, unconfirmed: list[tuple[int, IncidentRecord, asyncio.Future[bool]]],
                       out: Outcomes) -> None:
        """The creates of incidents dispatched before them, awaited. One found in etcd already (another leader
        opened it: the dispatch was the same, by its ids) is taken from etcd if it ended there; one whose create
        failed keeps its record here (written behind with its next step) and its fault is redelivered (its
        incident found open here: nothing is done twice)."""
        for i, rec, fut in unconfirmed:
            try:
                if await fut:
                    self._opened(rec)
                    continue
                loaded = await self.log.in_etcd(rec.id)
                log.warning("incident %s was opened already by another leader (%s); dispatched again (idempotent)",
                            rec.id, loaded.state if loaded is not None else "record gone")
                if loaded is not None and loaded.terminal:
                    self.open.put(loaded)
            except Exception as e:  # noqa: BLE001 - this fault alone is redelivered
                out[i] = e

    async def _apply(self, moves: list[Move], out: Outcomes) -> dict[str, int]:
        """Each move, in order, on its incident's latest record; the waiting states' entry actions done (the
        fallback's intent sent, a failure announced). Returns the incidents moved, by id: their message."""
        moved: dict[str, int] = {}
        moves = list(moves)  # a move may bring another (a cold engine found ready)
        for m in moves:
            try:
                rec = self.open.get(m.inc_id) or await self.log.load(m.inc_id)
                if rec is None:
                    continue
                new, stop = next_record(rec, m, time.time(), self.deadlines, held=m.inc_id in self.open)
                if stop is not None:  # a cold start superseded (a late reattach won): best effort
                    self.stops.stop(rec.id, *stop)
                if new is None:
                    continue
                if m.trigger is Trigger.RANK_FAULTED:
                    log.info("incident %s: rank %s of group %s faulted too (joins)", new.id, m.changes["rank"],
                             new.engine_id)
                if new.state is S.FALLBACK and rec.state is not S.FALLBACK:
                    await self.bus.publish(self.events.intent(new, fallback=True))
                    self.events.mark(new, new.model, time.time())  # its successor starts cold: routers hold
                if new.state is S.FAILED:  # recorded first, then announced (endings.py)
                    new.serves_on = serves_on(self.view, new)
                    new.successor_serves = not new.serves_on and successor_serves(self.view, new)
                    await self.ends.announce([(m.at, new, self._end(rec, new))], out)
                    continue
                # Entering route-in, the record is not written: route-in follows at once and writes the next
                # one (a crash before it redoes the step from the result, which is acked only after route-in).
                self._commit(rec, new, write=new.state is not S.ROUTING_IN)
                moved[m.inc_id] = m.at
                if m.trigger is Trigger.COLD_STARTED:
                    ready = self.view.engines.get(new.cold_successor_id or "")
                    if ready is not None and ready.state == "ready":  # ready before the spawn was answered
                        moves.append(cold_ready(m.inc_id, ready, at=m.at))
            except Exception as e:  # noqa: BLE001 - this message alone is redelivered
                out[m.at] = e
        return moved

    async def _advance(self, moved: dict[str, int], out: Outcomes) -> None:
        """Run the controller's own steps (route out and dispatch; route in and close) for every incident moved,
        each step for all of them at once, until each must wait for others."""
        while moved:
            opened, routing = {}, {}
            for inc_id, at in moved.items():
                rec = self.open.get(inc_id)
                if rec is not None and out[at] is None:
                    if rec.state is S.OPENED:
                        opened[inc_id] = at
                    elif rec.state is S.ROUTING_IN:
                        routing[inc_id] = at
            await self._route_in(routing, out)
            moved = await self._route_out(opened, out)

    async def _route_out(self, opened: dict[str, int], out: Outcomes) -> dict[str, int]:
        """Route out and dispatch (their events published together). The waiting state's record is written only
        if the incident still waits a moment later (a prompt takeover's incident goes from opened to resolved
        with no record in between; a new leader resumes it from opened: the dispatch is idempotent)."""
        if not opened:
            return {}
        staged = []
        for inc_id, at in opened.items():
            rec = self.open.get(inc_id)
            try:
                if rec is not None:
                    staged.append((rec, at, self.events.route_out(rec)))
            except Exception as e:  # noqa: BLE001 - redelivered (its record says opened)
                out[at] = e
        try:
            await self.bus.publish_all([ev for _, _, r in staged for ev in r.events])
        except Exception as e:  # noqa: BLE001 - none of them is routed out: all redelivered (idempotent)
            for _, at, _ in staged:
                out[at] = e
            return {}
        moved = {}
        for rec, at, r in staged:
            try:
                self._commit(rec, self.events.routed_out(r), after_s=self.settings.waiting_record_delay_s)
                moved[rec.id] = at
            except Exception as e:  # noqa: BLE001 - redelivered
                out[at] = e
        return moved

    async def _route_in(self, routing: dict[str, int], out: Outcomes) -> None:
        """Route in (the successors' endpoints published together), then close: each incident's resolved record
        written and confirmed, then its incident.resolved published (endings.py)."""
        if not routing:
            return
        staged = []
        for inc_id, at in routing.items():
            rec = self.open.get(inc_id)
            if rec is None:
                continue
            try:
                staged.append((rec, at, self.events.route_in(rec)))
            except Exception as e:  # noqa: BLE001 - redelivered
                self.log.save(rec)  # maybe not written on entry (see _apply): kept where it stands now
                out[at] = e
        try:
            await self.bus.publish_all([ev for _, _, r in staged for ev in r.events])
        except Exception as e:  # noqa: BLE001 - none routed in: each redelivered, its record kept as it stands
            for rec, at, _ in staged:
                self.log.save(rec)  # maybe not written on entry (see _apply): kept where it stands now
                out[at] = e
            return
        ends = []
        for rec, at, r in staged:
            try:
                ends.append((at, r.record, self._end(rec, r.record)))
                if rec.move_off and rec.successor_id != rec.engine_id:
                    # Drained: its successor serves now; stop it (best effort, like a superseded cold engine).
                    self.stops.stop(rec.id, rec.engine_id, rec.node)
            except Exception as e:  # noqa: BLE001 - redelivered
                out[at] = e
        await self.ends.announce(ends, out)

    def _end(self, old: IncidentRecord, new: IncidentRecord) -> asyncio.Future[bool]:
        """An incident ends (`new` is terminal): closed here at once, and its record's write started; the end is
        announced only once that write is confirmed (endings.py)."""
        self._commit(old, new, write=False)
        return self.log.write_soon(new)

    def _commit(self, old: IncidentRecord, new: IncidentRecord, *, write: bool = True, after_s: float = 0.0) -> None:
        """`new` is the incident's record from now on: in the table, and queued to etcd (written behind, fenced by
        the leader key: incident_log.py) unless `write` is False."""
        new.leader = self.settings.instance  # `new` is this call's own copy (apply and the callers copy)
        if write and after_s > 0:
            self.log.save_after(new, after_s)
        elif write:
            self.log.save(new)
        self.tracing.steps(old, new)
        self.open.put(new)
        if new.terminal:
            self.locks.ended(new.id)
            self.metrics.record_closed(new)
            self.tracing.close(new)
            log.info("incident %s %s in %s ms", new.id, new.state, new.total_ms())
