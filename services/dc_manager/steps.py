"""`IntentSteps`: one RecoverIntent's steps -> node commands (freeze, takeover; or a cold-start spawn) -> results.

Results: one per intent when it goes well and promptly (the reattach result carries the freeze's time,
`frozen_at`); a takeover still running `freeze_result_after_s` after its freeze gets a freeze result first;
a failed step gets a failed result (a failed takeover's carries `frozen_at` too). The result events are built
here once (`freeze_result`, `reattach_result`), for an intent stepped alone and for a batch's (executor.py).

Idempotent by recorded progress: the freeze's reply (and a cold start's) is stored at
`dcm/intents/<incident>-<kind>` before the next command is sent, so an intent redelivered after this
process died never freezes twice (the transfer token is reused) and re-sends the command it was in. The
record is read only on a redelivery (a first delivery has none), and written through a `BatchWriter`:
awaited, but grouped with other intents' writes into one etcd transaction. The takeover's reply is not
recorded: the agent's takeover is idempotent by incident (a repeated command gets the first one's
successor), so a redelivery that re-sends it gets the same reply; a record would only spare that one
re-sent command, and only if this process died in the moment between the record and the ack (the result
is published right after either way). Results carry ids derived from the intent, so a re-published
result is dropped by JetStream's duplicate window. Progress records are deleted after `progress_retention_s` (never sooner
than `progress_retention_min_s`: libs/common/retention.py), so that they do not pile up in etcd.

Errors: a node that does not answer is retried with backoff (temporary); a typed error reply (not_found,
conflict...) is permanent and becomes a failed result at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from libs.common import telemetry
from libs.common.bus import Bus, Wired, delivery_attempt, retried_unanswered, spans_exported
from libs.common.cluster_view import ClusterView, range_pages
from libs.common.errors import HoldfastError, RemoteError
from libs.common.etcd_batch import BatchWriter
from libs.common.events import (
    EngineInfo,
    EngineSpec,
    Freeze,
    FreezeGang,
    FreezeGangReply,
    FreezeReply,
    IncidentReason,
    IntentResult,
    LeaseInfo,
    LeaseState,
    ReclaimGang,
    ReclaimGangReply,
    RecoverIntent,
    Spawn,
    SpawnReply,
    Step,
    Tag,
    Takeover,
    TakeoverReply,
    holds_kv_backup,
    rank_engine_id,
)
from libs.common.ids import cold_engine_id, spec_key
from libs.common.store import Store
from services.dc_manager.placement import (
    Action,
    Placement,
    degrade_now,
    node_copies,
    place,
    place_degraded,
    released,
)
from services.dc_manager.settings import DcManagerSettings

# Engine classes that can continue a lost group alone from its ranks' KV backups (engines/batched/degrade.py), and
# a lost single engine from its own (`_from_backup`).
DEGRADABLE_CLASSES = frozenset({"batched"})
log = logging.getLogger("holdfast.dc_manager")
# The intent's trace, handed to its node commands as is when this process builds no spans of its own (no
# exporter): no propagator round trip (extract, attach, inject) per command.
_intent_trace: contextvars.ContextVar[str | None] = contextvars.ContextVar("hf_intent_trace", default=None)
# The incident of the intent being stepped (its node commands' retries ask whether it has ended meanwhile).
_intent_incident: contextvars.ContextVar[str | None] = contextvars.ContextVar("hf_intent_incident", default=None)
R = TypeVar("R", bound=BaseModel)


class IntentProgress(BaseModel):
    key: str
    incident_id: str
    freeze: FreezeReply | None = None
    gang: FreezeGangReply | None = None  # a TP group's freeze (all its ranks' leases, one token)
    freeze_ms: float | None = None
    frozen_at: float | None = None  # epoch seconds when the freeze answered (the results carry it)
    takeover: TakeoverReply | None = None
    takeover_ms: float | None = None
    spawn: SpawnReply | None = None
    spawn_ms: float | None = None
    memory_of: str | None = None  # the leases handed on are this engine's (see IntentExecutor._freeze)
    started_at: float = Field(default_factory=time.time)  # when its handling began (the retention of leftovers)


PROGRESS = "dcm/intents/"  # the etcd prefix of the progress records


def progress_key(key: str) -> str:
    return f"{PROGRESS}{key}"


# An incident record's states that never change again (services/controller/incident.py's TERMINAL).
ENDED_STATES = frozenset({"resolved", "failed"})


class IntentAbandoned(Exception):
    """The intent's incident has ended (resolved by another way, or failed): nothing it would do is wanted."""


class StepFailed(Exception):
    def __init__(self, step: Step, detail: str, code: str = "") -> None:
        super().__init__(detail)
        self.step = step
        self.detail = detail
        self.code = code  # the node's typed error code, if it answered with one


async def with_retries(call: Callable[[], Awaitable[R]], attempts: int, backoff_s: float,
                       ended: Callable[[], Awaitable[str | None]] | None = None, window_s: float = 0.0,
                       link: Any = None) -> R:
    """Retry while the node does not answer (libs/common/bus `retried_unanswered`); a typed error reply is final.
    Before each retry, `ended` says whether the intent's incident has ended meanwhile (then the intent is
    abandoned: IntentAbandoned)."""

    async def still_open() -> None:
        state = await ended() if ended is not None else None
        if state is not None:
            raise IntentAbandoned(f"its incident is {state}") from None

    return await retried_unanswered(call, attempts, backoff_s, still_open, window_s=window_s, link=link)


class IntentSteps:
    """The steps of one intent at a time, from its recorded progress (the caller holds its key's lock)."""

    def __init__(self, bus: Bus, store: Store, view: ClusterView, settings: DcManagerSettings) -> None:
        self.bus = bus
        self.store = store
        self.view = view
        self.settings = settings
        self.allowed = settings.node_set()
        self.tracer = telemetry.tracer("dc_manager")
        self.export_spans = spans_exported()  # no exporter: no spans (the incoming trace context still travels)
        self.writer = BatchWriter(store)
        # Progress records this process wrote: those of intents still running, and those of finished intents
        # (key -> when it finished, oldest first), deleted after their retention (app.py, libs/common/retention.py).
        self.written: set[str] = set()
        self.ended: dict[str, float] = {}

    def owns(self, intent: RecoverIntent) -> bool:
        return self.allowed is None or intent.node in self.allowed

    @staticmethod
    def key_of(intent: RecoverIntent) -> str:
        return f"{intent.incident_id}-{'fallback' if intent.memory_lost else 'recover'}"

    async def handle(self, intent: RecoverIntent, prog: IntentProgress, trace: str | None) -> None:
        """The intent's steps from `prog` on, under its key's lock (held by the caller); a failed step's result."""
        if not self.export_spans:
            _intent_trace.set(trace)
        _intent_incident.set(intent.incident_id)
        try:
            # A redelivery may come long after its incident ended (a result published, its ack lost in a NATS or
            # dc_manager restart): it runs only while the incident is open (the controller ignores late results
            # anyway; a takeover or spawn for an ended incident would only start an engine nobody routes).
            if delivery_attempt.get() != 1 and (state := await self.incident_ended()) is not None:
                raise IntentAbandoned(f"its incident is {state} already")
            if intent.memory_lost:
                await self._cold_start(intent, prog)
            elif intent.gang is not None:
                await self._reattach_gang(intent, prog)
            else:
                await self._reattach(intent, prog)
        except IntentAbandoned as e:
            log.info("intent %s abandoned: %s", prog.key, e)
        except StepFailed as e:
            log.warning("intent %s: %s failed: %s", prog.key, e.step, e.detail)
            await self._result(intent, e.step, ok=False, detail=e.detail,
                               frozen_at=prog.frozen_at if e.step is Step.REATTACH else None)

    # ------------------------------------------------------------ the two paths

    def in_place(self, intent: RecoverIntent, tp: int = 1) -> Placement:
        """Where a reattach goes: in place, on the engine's own GPU (a TP group's: its `tp` GPUs from it). Only
        those GPUs are looked at (no scan of the cluster per incident)."""
        home = {intent.node} if intent.node else set()
        slots = [self.view.gpu_slot(intent.node, intent.gpu + r) for r in range(tp)] if intent.node else []
        return place(intent.node, intent.gpu, memory_lost=False, needed_bytes=0, slots=[s for s in slots if s],
                     alive=home & self.view.nodes.keys(), allowed=self.allowed, tp=tp)

    async def _reattach(self, intent: RecoverIntent, prog: IntentProgress) -> None:
        where = self.in_place(intent)
        if where.action is not Action.REATTACH:  # the whole home node is placed again, for the reason it gives
            home = {intent.node} if intent.node else set()
            needed = sum(lease.size for lease in self.view.leases_of(intent.engine_id))
            where = place(intent.node, intent.gpu, memory_lost=False, needed_bytes=needed,
                          slots=self.view.gpu_slots(home), alive=home & self.view.nodes.keys(), allowed=self.allowed)
            raise StepFailed(Step.FREEZE, f"cannot reattach in place: {where.reason}")
        node = where.node or ""
        early: asyncio.Task[tuple[TakeoverReply, float]] | None = None
        if prog.freeze is None:
            token = None
            if prog.takeover is None and self.promote_early(intent):
                # The shadow needs no memory to serve (it maps the weights read-only already): promote it now,
                # with a token chosen here, which it needs only to own the leases once they are frozen.
                token = secrets.token_urlsafe(24)
                early = asyncio.ensure_future(self._takeover(node, self.takeover(intent, token)))
            cmd = Freeze(owner=intent.engine_id, incident_id=intent.incident_id, transfer_token=token)
            try:
                prog.freeze, prog.freeze_ms = await self._freeze(intent, node, cmd, prog)
            except StepFailed:
                if early is not None:
                    early.cancel()  # only our wait: the promoted shadow, never owning the leases, exits (75)
                raise
            prog.frozen_at = time.time()
            if prog.freeze.handed_to is not None:  # the node's agent froze them and promoted its standby itself
                # (agent takeover.py `promote`): the takeover sent here joins that one (one per incident)
                log.info("intent %s: %s's leases were taken over already by %s", prog.key, intent.engine_id,
                         prog.freeze.handed_to)
            elif early is not None and prog.freeze.transfer_token != token:
                log.warning("intent %s: %s was frozen already under another token: the early-promoted shadow cannot "
                            "own its leases, unless the node's agent promoted it (its takeover joined)", prog.key,
                            intent.engine_id)
            await self.save(prog)  # what makes the freeze resumable: a redelivered intent reuses its token
        await self._take_over(intent, prog, node, self.takeover(intent, prog.freeze.transfer_token, prog.memory_of),
                              early)

    async def _take_over(self, intent: RecoverIntent, prog: IntentProgress, node: str, cmd: Takeover,
                         early: asyncio.Task[tuple[TakeoverReply, float]] | None = None) -> None:
        """The takeover (unless recorded), then the reattach's result."""
        trace = _intent_trace.get()
        if prog.takeover is None:
            # One result per intent when the takeover is prompt (the usual case: a warm standby). A slow one
            # gets the freeze's own result first, so the controller trades its short freeze deadline for the
            # reattach deadline while the successor starts.
            announced: list[asyncio.Task[None]] = []
            timer = asyncio.get_running_loop().call_later(
                self.settings.freeze_result_after_s, lambda: announced.append(asyncio.ensure_future(
                    self.publish([self.freeze_result(intent, prog, trace)]))))
            try:
                prog.takeover, prog.takeover_ms = await (early or self._takeover(node, cmd))
            finally:
                timer.cancel()
                for task in announced:
                    await task
            # Not recorded (see the module's docstring): a redelivery re-sends the takeover, idempotent by incident.
        await self.publish([self.reattach_result(intent, prog, trace, promoted_early=early is not None)])

    async def _reattach_gang(self, intent: RecoverIntent, prog: IntentProgress) -> None:
        """A tensor-parallel group: every rank's leases frozen under one token (`FreezeGang`: all or none, a stale or
        partial gang refused), then a successor group started on the node takes the whole gang over (no standby
        groups yet). In place only: the gang's leases are on this node's GPUs."""
        assert intent.gang is not None
        tp = (self.view.engine_raw.get(intent.engine_id) or {}).get("tp")
        where = self.in_place(intent, tp if isinstance(tp, int) and tp > 1 else 1)
        if where.action is not Action.REATTACH:
            raise StepFailed(Step.FREEZE, f"cannot reattach group {intent.engine_id} in place: {where.reason}")
        node = where.node or ""
        if prog.gang is None:
            cmd = FreezeGang(gang_id=intent.gang, incident_id=intent.incident_id)
            prog.gang, prog.freeze_ms = await self._command(Step.FREEZE, node, cmd, FreezeGangReply,
                                                            self.settings.freeze_timeout_s)
            prog.frozen_at = time.time()
            await self.save(prog)  # a redelivered intent reuses the token and generation
        cmd2 = Takeover(incident_id=intent.incident_id, engine_id=intent.engine_id,
                        transfer_token=prog.gang.transfer_token, version=intent.version, gang=intent.gang,
                        gang_generation=prog.gang.generation)
        await self._take_over(intent, prog, node, cmd2)

    def promote_early(self, intent: RecoverIntent, attempt: int | None = None) -> bool:
        """Promote while freezing: a first delivery (a redelivery runs the steps in order, and the freeze says
        which token holds), the engine's leases not frozen already, and a standby beside it that shadows it
        (and is the one named, if one is)."""
        if not self.settings.promote_shadows_early or (delivery_attempt.get() if attempt is None else attempt) != 1:
            return False
        if any(lease.state is LeaseState.FROZEN for lease in self.view.leases_of(intent.engine_id)):
            return False
        shadow = self.view.shadow_of(intent.engine_id, intent.node)
        return shadow is not None and intent.successor in (None, shadow.engine_id)

    async def _freeze(self, intent: RecoverIntent, node: str, cmd: Freeze,
                      prog: IntentProgress) -> tuple[FreezeReply, float]:
        """The failed engine's leases frozen. One that holds no weights but is a successor (a shadow promoted while
        its predecessor's freeze ran, which serves at once and owns those leases only once the predecessor is dead)
        died before it owned them: they are still its predecessor's, frozen under their first token, and are
        handed on (`memory_of`: a second freeze of frozen leases answers with their token) rather than left
        frozen until reclaimed while a cold start looks for room. What it held of its own (the KV cache a shadow
        leases) stays frozen until its grace window ends."""
        info = self.view.engines.get(intent.engine_id)
        pred = info.successor_of if info is not None else None
        if pred == intent.engine_id:
            pred = None
        try:
            got = await self._command(Step.FREEZE, node, cmd, FreezeReply, self.settings.freeze_timeout_s)
        except StepFailed as e:
            if e.code != "not_found" or not pred:
                raise
        else:
            if not pred or any(lease.tag == Tag.WEIGHTS for lease in got[0].leases):
                return got
        assert pred is not None
        log.warning("intent %s: %s holds no weights; handing on %s's, which it died before owning",
                    prog.key, intent.engine_id, pred)
        handed = await self._command(Step.FREEZE, node, Freeze(owner=pred, incident_id=intent.incident_id),
                                     FreezeReply, self.settings.freeze_timeout_s)
        prog.memory_of = pred
        return handed

    @staticmethod
    def takeover(intent: RecoverIntent, token: str, memory_of: str | None = None) -> Takeover:
        return Takeover(incident_id=intent.incident_id, engine_id=intent.engine_id, transfer_token=token,
                        successor=intent.successor, version=intent.version, memory_of=memory_of)

    async def _cold_start(self, intent: RecoverIntent, prog: IntentProgress) -> None:
        if prog.spawn is None:
            spec = self.spec_for(intent)
            if spec is None:
                raise StepFailed(Step.FALLBACK, f"no engine spec for {intent.engine_id} (class {intent.engine_class})")
            # a TP group's ranks each need room for their own leases, on GPUs base..base+tp-1
            by_rank = [self.view.leases_of(rank_engine_id(intent.engine_id, r)) for r in range(spec.tp)]
            needed = max(sum(lease.size for lease in leases) for leases in by_rank)
            if intent.reason is IncidentReason.REGROUP:
                await self._regroup(intent, spec, prog)  # a whole group, or the engine itself serving on
            elif spec.tp > 1:
                await self._degrade(intent, spec, by_rank, needed, prog)
            else:
                await self._from_backup(intent, spec, by_rank[0], prog)
            if prog.spawn is None:
                await self._spawn_cold(intent, spec, needed, prog)
        assert prog.spawn is not None
        engine = prog.spawn.engine
        await self._result(intent, Step.FALLBACK, ok=True, successor=engine.engine_id, endpoint=engine.endpoint,
                           timings={"fallback": prog.spawn_ms or 0.0}, detail=engine.state, node=engine.node)

    async def _spawn_cold(self, intent: RecoverIntent, spec: EngineSpec, needed: int, prog: IntentProgress) -> None:
        if spec.tp == 1 and intent.node and (spare := self.view.spare_on(
                intent.node, spec.model, spec.engine_class, intent.version or spec.version)) is not None:
            # serves at once, its weights loaded already (no KV backup to continue: the routers replay the streams)
            await self._on_spare(intent, spec, spare, prog)
            return
        freed = await self._reclaim_lost_gang(intent)
        cold_id = cold_engine_id(intent.incident_id)
        started = self.view.engines.get(cold_id)
        if started is not None and started.node in self.view.nodes:
            # this intent's cold start began already (an intent sent again by a new leader, whose progress record
            # was not written yet): asked again where it runs, which answers the engine started (idempotent by its
            # id), never placed anew (a probe of 2026-12-07 saw a second engine of that id on another node)
            where = Placement(Action.COLD_START, started.node, started.gpu, "its cold start began there")
            full: set[str] = set()
        else:
            where, full = self._place_cold(intent, spec, needed, freed)
        if where.action is Action.NONE:
            at_count = f"; running their count of this spec already: {', '.join(sorted(full))}" if full else ""
            raise StepFailed(Step.FALLBACK, where.reason + at_count)
        spec = spec.model_copy(update={"gpus": [where.gpu or 0], "rank_gpus": where.rank_gpus,
                                       "version": intent.version or spec.version})
        cmd = Spawn(spec=spec, engine_id=cold_id, incident_id=intent.incident_id)
        prog.spawn, prog.spawn_ms = await self._command(Step.FALLBACK, where.node or "", cmd, SpawnReply,
                                                        self.settings.spawn_timeout_s)
        await self.save(prog)

    def _place_cold(self, intent: RecoverIntent, spec: EngineSpec, needed: int,
                    freed: list[LeaseInfo]) -> tuple[Placement, set[str]]:
        """Where a cold start goes, and the nodes left out for running the spec's count of actives already."""
        # A node holding a copy of the weights (host tier, artifact) restores them at PCIe or disk speed:
        # preferred over a read of the original file (a scan of the GPU records: cold starts are rare).
        # A node whose agent runs this spec's count of actives already refuses one more: not offered
        full = self.view.nodes_at_count(spec_key(spec.model, spec.engine_class, intent.version or spec.version),
                                        replacing=intent.engine_id)
        allowed = self.allowed
        if full:
            allowed = frozenset((set(self.view.nodes) if allowed is None else set(allowed)) - full)
        where = place(intent.node, intent.gpu, memory_lost=True, needed_bytes=needed,
                      slots=released(self.view.gpu_slots(), freed), alive=set(self.view.nodes),
                      allowed=allowed, copies=node_copies(self.view.gpus, intent.engine_class), tp=spec.tp)
        return where, full

    async def _degrade(self, intent: RecoverIntent, spec: EngineSpec, by_rank: list[list[LeaseInfo]], needed: int,
                       prog: IntentProgress) -> None:
        """FailSafe's degraded serving (docs/multi_gpu.md, part 6): a group whose memory is lost is continued by fewer
        ranks on healthy GPUs of its node, from its ranks' KV backups (host memory there), when its spec's `degrade`
        says so (by default when no whole group can be placed, its GPUs counted as freed) and its gang can be frozen
        degraded (every rank's backup held: gpu_manager gang.py invariant 10). Anything short of that leaves
        `prog.spawn` unset: the plain cold start follows (and fails with placement's reason when no group fits).
        `by_rank`: each rank's leases as the view holds them; `needed`: a whole group's room a rank."""
        if intent.gang is None or intent.node not in self.view.nodes or spec.engine_class not in DEGRADABLE_CLASSES:
            return  # (a node gone from the view is asked nothing: its backups went with it)
        version = intent.version or spec.version
        if spec.degrade == "never" and self.view.spare_on(intent.node, spec.model, spec.engine_class, version,
                                                          tp=spec.tp) is None:
            return  # neither fewer ranks nor a spare group: nothing to freeze the backups for
        try:  # first: its backups kept whatever comes (a whole group's cold start below reclaims them after all)
            frozen, _ = await self._command(Step.FALLBACK, intent.node, FreezeGang(
                gang_id=intent.gang, incident_id=intent.incident_id, degraded=True), FreezeGangReply,
                self.settings.freeze_timeout_s)
        except StepFailed as e:
            log.info("intent %s: gang %s cannot be degraded (%s): a cold start", intent.incident_id, intent.gang,
                     e.detail)
            return
        # the node's GPU health as its gpu_manager holds it now: the view may not have the fault's record yet
        slots = [dataclasses.replace(s, healthy=False) if s.node == intent.node and s.gpu in frozen.unhealthy_gpus
                 else s for s in released(self.view.gpu_slots(), [lease for leases in by_rank for lease in leases])]
        spare = self.view.spare_on(intent.node, spec.model, spec.engine_class, version, set(frozen.unhealthy_gpus),
                                   tp=spec.tp)
        if spare is not None:  # a whole group, its shards and caches leased already: better than either below
            await self._on_spare(intent, spec, spare, prog, degrade_gang=intent.gang,
                                 transfer_token=frozen.transfer_token, gang_generation=frozen.generation,
                                 predecessor=intent.engine_id)
            return
        if spec.degrade == "never":
            return  # the cold start reclaims the frozen gang (`_reclaim_lost_gang`)
        whole = place(intent.node, intent.gpu, memory_lost=True, needed_bytes=needed, slots=slots,
                      alive=set(self.view.nodes), allowed=self.allowed, tp=spec.tp)
        if not degrade_now(spec.degrade, whole):
            return  # a whole group fits somewhere: the better successor, unless the spec degrades first
        # the group's device memory, weights and caches, shared by the fewer ranks (a lost rank's leases may be gone
        # from the view: every rank counted as the largest one left)
        device = max(sum(lease.size for lease in leases if not lease.host) for leases in by_rank)
        ranks, where = place_degraded(intent.node, spec.tp, device * spec.tp, slots=slots, alive=set(self.view.nodes),
                                      allowed=self.allowed)
        if where.action is Action.NONE:
            log.info("intent %s: %s not degraded either: %s", intent.incident_id, intent.engine_id, where.reason)
            return
        fewer = spec.model_copy(update={"tp": len(ranks), "gpus": ranks[:1], "rank_gpus": ranks if len(ranks) > 1 else [],
                                        "version": intent.version or spec.version})
        cmd = Spawn(spec=fewer, engine_id=cold_engine_id(intent.incident_id), incident_id=intent.incident_id,
                    degrade_gang=intent.gang, transfer_token=frozen.transfer_token,
                    gang_generation=frozen.generation, predecessor=intent.engine_id)
        why = "its spec degrades first" if whole.action is not Action.NONE else f"no whole group: {whole.reason}"
        log.info("intent %s: %s (%s): %s, from its ranks' KV backups", intent.incident_id, intent.engine_id, why,
                 where.reason)
        prog.spawn, prog.spawn_ms = await self._command(Step.FALLBACK, where.node or "", cmd, SpawnReply,
                                                        self.settings.spawn_timeout_s)
        await self.save(prog)

    async def _from_backup(self, intent: RecoverIntent, spec: EngineSpec, leases: list[LeaseInfo],
                           prog: IntentProgress) -> None:
        """A single engine whose weights and cache were lost (its GPU failed, or they were reclaimed) while its KV
        backup lives (host memory on its node: docs/kv_backup.md): a cold engine on a healthy GPU of that node takes
        the backup over, loads the weights itself and continues every sequence from it, rather than a cold start
        that prefills every one again from the router's replay. Anything short of that (no backup, none committed,
        no room on that node) leaves `prog.spawn` unset: the plain cold start follows. `leases`: the engine's as the
        view holds them."""
        backups = [lease for lease in leases if holds_kv_backup(lease)]
        if not backups or intent.node not in self.view.nodes or spec.engine_class not in DEGRADABLE_CLASSES:
            return  # (a node gone from the view is asked nothing: its backup went with it)
        try:
            frozen, _ = await self._command(Step.FALLBACK, intent.node, Freeze(
                owner=intent.engine_id, incident_id=intent.incident_id, backups_only=True), FreezeReply,
                self.settings.freeze_timeout_s)
        except StepFailed as e:
            log.info("intent %s: the KV backup of %s cannot be handed on (%s): a cold start", intent.incident_id,
                     intent.engine_id, e.detail)
            return
        spare = self.view.spare_on(intent.node, spec.model, spec.engine_class, intent.version or spec.version,
                                   set(frozen.unhealthy_gpus))
        if spare is not None:  # its weights loaded already, on a healthy GPU: it takes the backup over and serves
            await self._on_spare(intent, spec, spare, prog, backup_of=intent.engine_id,
                                 transfer_token=frozen.transfer_token)
            return
        device = [lease for lease in leases if not lease.host]
        # the node's GPU health as its gpu_manager holds it now (the view may not have the fault's record yet); the
        # lost leases the view still counts given back; room for the lost ones (at least a cache the backup's size)
        slots = [dataclasses.replace(s, healthy=False) if s.gpu in frozen.unhealthy_gpus else s
                 for s in released(self.view.gpu_slots({intent.node}), device)]
        needed = max(sum(lease.size for lease in device), sum(lease.size for lease in backups))
        where = place(intent.node, intent.gpu, memory_lost=True, needed_bytes=needed, slots=slots,
                      alive={intent.node} & set(self.view.nodes), allowed=self.allowed,
                      copies=node_copies(self.view.gpus, intent.engine_class))
        if where.action is Action.NONE:
            log.info("intent %s: no GPU on %s, where the KV backup of %s is: %s", intent.incident_id, intent.node,
                     intent.engine_id, where.reason)
            return
        successor = spec.model_copy(update={"gpus": [where.gpu or 0], "version": intent.version or spec.version})
        cmd = Spawn(spec=successor, engine_id=cold_engine_id(intent.incident_id), incident_id=intent.incident_id,
                    backup_of=intent.engine_id, transfer_token=frozen.transfer_token)
        log.info("intent %s: %s from its KV backup: %s", intent.incident_id, intent.engine_id, where.reason)
        prog.spawn, prog.spawn_ms = await self._command(Step.FALLBACK, intent.node, cmd, SpawnReply,
                                                        self.settings.spawn_timeout_s)
        await self.save(prog)

    async def _on_spare(self, intent: RecoverIntent, spec: EngineSpec, spare: EngineInfo, prog: IntentProgress,
                        **handed: Any) -> None:
        """The incident's successor is `spare` (EngineSpec.spares: a standby, or standby group, on other GPUs of the
        node, its weights and cache leased at its start): the agent assigns it rather than starting a process (or,
        the spare gone meanwhile, starts a cold one on its GPUs). `handed`: what it continues from: `backup_of` and
        `transfer_token` (a single engine's KV backup frozen alone), or `degrade_gang`, `transfer_token`,
        `gang_generation` and `predecessor` (a group's gang frozen degraded: every rank's backup)."""
        version = intent.version or spec.version
        cmd = Spawn(spec=spec.model_copy(update={"gpus": [spare.gpu], "rank_gpus": [], "version": version}),
                    engine_id=cold_engine_id(intent.incident_id), incident_id=intent.incident_id,
                    spare=spare.engine_id, **handed)
        log.info("intent %s: %s's successor is spare %s on GPU %d%s", intent.incident_id, intent.engine_id,
                 spare.engine_id, spare.gpu, ", from its KV backup" if handed else "")
        prog.spawn, prog.spawn_ms = await self._command(Step.FALLBACK, intent.node or "", cmd, SpawnReply,
                                                        self.settings.spawn_timeout_s)
        await self.save(prog)

    async def _regroup(self, intent: RecoverIntent, spec: EngineSpec, prog: IntentProgress) -> None:
        """A degraded engine (fewer ranks than its spec: one engine, or a smaller group, continuing a group that lost a
        GPU: docs/multi_gpu.md part 6) replaced by a whole group on its node once the GPUs are there again, every
        sequence continued from its KV backups: a whole group placed first (the engine's GPU memory counted as freed:
        the agent stops it before the group starts), then its backups frozen alone (one engine's:
        `Freeze(backups_only)`; a group's: its gang frozen degraded) and the group spawned (`Spawn(backup_of)`,
        `Spawn(degrade_gang)`): the agent stops the engine, the group's rank 0 takes the backups over and every
        rank restores its kv heads of every sequence (engines/batched/degrade.py). Not such an engine, or no whole
        group fits (the controller checked the GPUs' health, not their room), or its backups cannot be frozen:
        nothing is touched and the engine itself is the fallback's successor, routed back in (it serves on)."""
        engine = self.view.engines.get(intent.engine_id)
        if engine is None or not intent.node:
            raise StepFailed(Step.FALLBACK, f"no record of {intent.engine_id}: nothing to regroup")
        leases = [lease for r in range(engine.tp) for lease in self.view.leases_of(rank_engine_id(engine.engine_id, r))]
        device = [lease for lease in leases if not lease.host]
        needed = -(-sum(lease.size for lease in device) // spec.tp)  # each rank's share of the engine's memory
        where = place(intent.node, intent.gpu, memory_lost=True, needed_bytes=needed,
                      slots=released(self.view.gpu_slots({intent.node}), device),
                      alive={intent.node} & set(self.view.nodes), allowed=self.allowed, tp=spec.tp)
        backed = sum(1 for lease in leases if holds_kv_backup(lease))
        why = None
        if engine.tp >= spec.tp or spec.engine_class not in DEGRADABLE_CLASSES:
            why = f"it runs {engine.tp} ranks of a {spec.engine_class} spec of {spec.tp}: not a degraded engine"
        elif backed != engine.tp:
            why = f"{backed} of its {engine.tp} ranks keep a KV backup"
        elif where.action is Action.NONE:
            why = f"no whole group of {spec.tp} on {intent.node}: {where.reason}"
        whole = spec.model_copy(update={"gpus": [where.gpu or 0], "rank_gpus": where.rank_gpus,
                                        "version": intent.version or spec.version})
        cmd = Spawn(spec=whole, engine_id=cold_engine_id(intent.incident_id), incident_id=intent.incident_id)
        try:
            if why is not None:
                raise StepFailed(Step.FALLBACK, why)
            if engine.tp == 1:
                frozen, _ = await self._command(Step.FALLBACK, intent.node, Freeze(
                    owner=engine.engine_id, incident_id=intent.incident_id, backups_only=True), FreezeReply,
                    self.settings.freeze_timeout_s)
                cmd = cmd.model_copy(update={"backup_of": engine.engine_id, "transfer_token": frozen.transfer_token})
            else:
                gang, _ = await self._command(Step.FALLBACK, intent.node, FreezeGang(
                    gang_id=engine.gang or engine.engine_id, incident_id=intent.incident_id, degraded=True),
                    FreezeGangReply, self.settings.freeze_timeout_s)
                cmd = cmd.model_copy(update={"degrade_gang": gang.gang_id, "transfer_token": gang.transfer_token,
                                             "gang_generation": gang.generation, "predecessor": engine.engine_id})
        except StepFailed as e:  # nothing touched: it serves on, routed back in as the incident's successor
            log.warning("intent %s: %s not regrouped, it serves on: %s", intent.incident_id, intent.engine_id, e.detail)
            prog.spawn, prog.spawn_ms = SpawnReply(engine=engine), 0.0
            await self.save(prog)
            return
        log.info("intent %s: %s regrouped: %s", intent.incident_id, intent.engine_id, where.reason)
        prog.spawn, prog.spawn_ms = await self._command(Step.FALLBACK, intent.node, cmd, SpawnReply,
                                                        self.settings.spawn_timeout_s)
        await self.save(prog)

    async def _reclaim_lost_gang(self, intent: RecoverIntent) -> list[LeaseInfo]:
        """A tensor-parallel group whose memory is lost (a rank's GPU failed, or its gang can no longer be taken
        over): every lease of its gang is reclaimed before its new group is placed, so that the memory on the
        healthy GPUs is there for it. Forced: a rank on a healthy GPU may not be dead yet (the agent kills the group
        on the fault), and no successor can ever map a broken gang. Only while the gang is still this group's
        (`group`): a successor group's is never touched. The gpu_manager reclaims a broken gang by itself once its
        ranks are dead (reconciler rule 6), but only if it heard of the fault; this does not depend on that. Best
        effort: a failure is logged and the cold start goes on. Returns the leases reclaimed, as the view knew them."""
        if intent.gang is None or intent.node not in self.view.nodes:
            return []  # (a node gone from the view is asked nothing: its gang went with it)
        cmd = ReclaimGang(gang_id=intent.gang, force=True, group=intent.engine_id, incident_id=intent.incident_id)
        try:
            reply, ms = await self._command(Step.FALLBACK, intent.node, cmd, ReclaimGangReply,
                                            self.settings.freeze_timeout_s)
        except StepFailed as e:
            log.warning("intent %s: gang %s of %s not reclaimed before its cold start: %s", intent.incident_id,
                        intent.gang, intent.engine_id, e.detail)
            return []
        log.info("intent %s: gang %s of %s reclaimed before its cold start: %d leases in %.1f ms", intent.incident_id,
                 intent.gang, intent.engine_id, len(reply.lease_ids), ms)
        return [self.view.leases[i] for i in reply.lease_ids if i in self.view.leases]

    def spec_for(self, intent: RecoverIntent) -> EngineSpec | None:
        """The engine's own recorded spec, else `specs/<class>` in etcd (or the spec an agent runs that class
        with), else this manager's config; whichever it is names the intent's model (never another model's)."""
        raw = (self.view.engine_raw.get(intent.engine_id) or {}).get("spec")
        if raw is None:
            raw = self.view.spec_of(intent.engine_class, intent.model)
        if raw is not None:
            try:
                return EngineSpec.model_validate(raw)
            except ValueError as e:
                log.warning("bad spec for %s: %s", intent.engine_id, e)
        configured = self.settings.specs.get(intent.engine_class)
        return configured if configured is not None and configured.model == intent.model else None

    # ------------------------------------------------------------ plumbing

    async def _takeover(self, node: str, cmd: Takeover) -> tuple[TakeoverReply, float]:
        """A takeover, each request waiting `takeover_attempt_s` and sent again until `takeover_timeout_s` has passed
        (idempotent by incident: a live agent joins the first; a restarted one, which lost it, runs it)."""
        s = self.settings
        return await self._command(Step.REATTACH, node, cmd, TakeoverReply, min(s.takeover_attempt_s,
                                                                                s.takeover_timeout_s),
                                   window_s=s.takeover_timeout_s)

    async def _command(self, step: Step, node: str, cmd: object, reply: type[R], wait_s: float, *,
                       window_s: float | None = None) -> tuple[R, float]:
        with self.span(f"dc_manager.{step}", {"holdfast.node": node}):
            t0 = time.perf_counter()
            try:
                trace = _intent_trace.get()
                out = await with_retries(lambda: self.bus.request(node, cmd, reply, timeout=wait_s,  # type: ignore[arg-type]
                                                                  traceparent=trace),
                                         self.settings.retries, self.settings.retry_backoff_s, self.incident_ended,
                                         self.settings.retry_window_s if window_s is None else window_s,
                                         link=self.bus.nc)
            except RemoteError as e:
                raise StepFailed(step, f"{e.remote_code}: {e.message}", e.remote_code) from None
            except HoldfastError as e:
                raise StepFailed(step, f"{e.code}: {e.message}", e.code) from None
            return out, round((time.perf_counter() - t0) * 1000.0, 3)

    def span(self, name: str, attributes: dict[str, str | bool]) -> contextlib.AbstractContextManager[object]:
        if not self.export_spans:
            return contextlib.nullcontext()
        return self.tracer.start_as_current_span(name, attributes=attributes)

    async def _result(self, intent: RecoverIntent, step: Step, *, ok: bool, detail: str = "",
                      successor: str | None = None, endpoint: str | None = None,
                      timings: dict[str, float] | None = None, node: str | None = None,
                      frozen_at: float | None = None) -> None:
        await self.publish([self.result_event(intent, step, ok=ok, detail=detail, successor=successor,
                                              endpoint=endpoint, timings=timings, node=node, frozen_at=frozen_at,
                                              trace=_intent_trace.get())])

    async def publish(self, results: list[Wired]) -> None:
        if results:  # their acks awaited without a request (and its timer) per result
            await self.bus.publish_all(results)

    def freeze_result(self, intent: RecoverIntent, prog: IntentProgress, trace: str | None) -> Wired:
        """The freeze's own result, for a takeover still running `freeze_result_after_s` after it."""
        return self.result_event(intent, Step.FREEZE, ok=True, timings={"freeze": prog.freeze_ms or 0.0},
                                 frozen_at=prog.frozen_at, trace=trace)

    def reattach_result(self, intent: RecoverIntent, prog: IntentProgress, trace: str | None, *,
                        promoted_early: bool = False) -> Wired:
        """The reattach's result (the successor, every step's timing, the freeze's end)."""
        assert prog.takeover is not None
        engine = prog.takeover.engine
        overlap = {"promoted_during_freeze": 1.0} if promoted_early else {}
        return self.result_event(intent, Step.REATTACH, ok=True, successor=engine.engine_id, endpoint=engine.endpoint,
                                 timings={**prog.takeover.timings_ms, "reattach": prog.takeover_ms or 0.0,
                                          "freeze": prog.freeze_ms or 0.0, **overlap},
                                 detail="standby" if prog.takeover.used_standby else "cold-spawned",
                                 frozen_at=prog.frozen_at, trace=trace, kv=engine.kv or "")

    def result_event(self, intent: RecoverIntent, step: Step, *, ok: bool, detail: str = "",
                      successor: str | None = None, endpoint: str | None = None,
                      timings: dict[str, float] | None = None, node: str | None = None,
                      frozen_at: float | None = None, trace: str | None = None, kv: str = "") -> Wired:
        result = IntentResult(incident_id=intent.incident_id, step=step, ok=ok, detail=detail, successor_id=successor,
                              endpoint=endpoint, timings_ms=timings or {}, node=node, frozen_at=frozen_at, kv=kv)
        return self.bus.wired(result, id=f"{self.key_of(intent)}-{step}-result", traceparent=trace)

    async def incident_ended(self) -> str | None:
        """The state of the current intent's incident if it has ended (its record in etcd, written before its end
        is announced), else None (open, unknown, or etcd not answering: the intent goes on)."""
        inc_id = _intent_incident.get()
        if inc_id is None:
            return None
        try:
            raw = await self.store.get(f"incidents/{inc_id}")
            state = json.loads(raw).get("state") if raw is not None else None
        except Exception as e:  # noqa: BLE001 - unknown: the intent goes on (the controller ignores a late result)
            log.debug("intent of %s: its incident's record unread: %s", inc_id, e)
            return None
        return state if state in ENDED_STATES else None

    async def load(self, key: str) -> IntentProgress | None:
        return await self.store.get_model(progress_key(key), IntentProgress)

    async def save(self, prog: IntentProgress) -> None:
        self.written.add(prog.key)
        await self.writer.put(progress_key(prog.key), prog)

    async def adopt_leftovers(self) -> int:
        """Progress records already in etcd at start (a dead manager's, or this datacenter's other managers'):
        handed to the retention by when their intent began, so that none stays for good. An intent still running
        elsewhere is far younger than `progress_retention_s`. Returns how many."""
        items, _ = await range_pages(self.store, PROGRESS)
        found: dict[str, float] = {}
        for key, raw in items:
            try:
                began = IntentProgress.model_validate_json(raw).started_at
            except ValidationError:
                began = time.time()  # unreadable: goes after a full retention
            found[key.removeprefix(PROGRESS)] = began
        merged = {**found, **self.ended}
        self.ended.clear()
        self.ended.update(sorted(merged.items(), key=lambda item: item[1]))
        return len(found)

    def finished(self, key: str) -> None:
        """The intent of `key` is handled (its result published): its progress record, if any, may go later."""
        if key in self.written:
            self.written.discard(key)
            self.ended[key] = time.time()

    def forget(self, key: str) -> None:
        """Delete a progress record past its retention (written behind)."""
        self.writer.delete_nowait(progress_key(key))
