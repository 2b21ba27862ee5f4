"""`IntentExecutor`: the dc_manager's recover intents, as they are delivered (`Bus.durable_batches`).

What arrives in one loop pass is handled together; each intent keeps its own lock (by key: incident and
kind), progress record, derived result ids and ack. Its steps are `IntentSteps`' (steps.py). The common case,
a first delivery of a reattach in place (no shadow promoted early, no predecessor's memory to hand on, no
spans exported), runs each step for the whole batch at once: the freezes sent together (one timer, one
wake-up per loop pass that brings replies), their progress records queued together (one etcd transaction
through the `BatchWriter`), the takeovers sent together, and the results of the takeovers that answered in
one loop pass published with one `publish_all`. A takeover still running `freeze_result_after_s` after
the freezes gets the freeze's own result first. Any other intent (a redelivery, a cold start, a placement
elsewhere, an early promotion), and one whose freeze or takeover did not answer well here, goes on alone
from its recorded progress through the same steps (`IntentSteps.handle`: retries, typed errors, a failed
result), so a node that is slow or gone costs the batch's first attempt plus the usual ones.

Before any of that, an intent of a controller term that has ended is refused (terms.py): one etcd read per batch
of intents that carry a term.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

from libs.common import telemetry
from libs.common.bus import Bus, beside, delivery_attempt, delivery_attempts, holding
from libs.common.cluster_view import ClusterView
from libs.common.errors import HoldfastError, StaleTerm
from libs.common.events import Envelope, Freeze, FreezeReply, RecoverIntent, TakeoverReply
from libs.common.store import Store
from services.dc_manager.placement import Action
from services.dc_manager.settings import DcManagerSettings
from services.dc_manager.steps import IntentProgress, IntentSteps, progress_key
from services.dc_manager.terms import current_term, refusal

__all__ = ["IntentExecutor", "IntentProgress", "progress_key"]

log = logging.getLogger("holdfast.dc_manager")


@dataclass
class _Item:
    """One intent of a batch on the common path."""

    at: int  # its position in the batch
    intent: RecoverIntent
    node: str
    trace: str | None
    prog: IntentProgress
    announced: bool = False  # its freeze result is published (the takeover was slow)
    alone: asyncio.Task[None] | None = field(default=None, repr=False)  # going on alone from its progress


class IntentExecutor:
    def __init__(self, bus: Bus, store: Store, view: ClusterView, settings: DcManagerSettings) -> None:
        self.bus = bus
        self.view = view
        self.settings = settings
        self.steps = IntentSteps(bus, store, view, settings)
        self._locks: dict[str, asyncio.Lock] = {}  # by intent key: one handler at a time
        self.handled = 0
        self.refused = 0  # intents of a controller term that had ended (terms.py)

    @property
    def export_spans(self) -> bool:
        return self.steps.export_spans

    @export_spans.setter
    def export_spans(self, on: bool) -> None:
        self.steps.export_spans = on

    key_of = staticmethod(IntentSteps.key_of)

    async def on_intents(self, envs: list[Envelope]) -> list[BaseException | None]:
        """Intents delivered in one loop pass; per intent, in order: None (handled: acked) or what failed it."""
        attempts = delivery_attempts.get() or (0,) * len(envs)
        out: list[BaseException | None] = [None] * len(envs)
        items: list[_Item] = []
        alone: dict[int, Awaitable[None]] = {}
        keys: set[str] = set()
        try:
            term = await self._term_now(envs)
        except Exception as e:  # noqa: BLE001 - etcd not answering: every intent redelivered, none run unchecked
            return [e] * len(envs)
        for i, env in enumerate(envs):
            intent = env.data
            refused = None
            if isinstance(intent, RecoverIntent) and self.steps.owns(intent):
                refused = refusal(intent.term, term)
                if refused is not None and not isinstance(refused, StaleTerm):
                    out[i] = refused  # terms.py rule 3: redelivered
                    continue
                if refused is not None and attempts[i] == 1:  # nothing recorded: it was never accepted
                    self._refuse(intent, refused)
                    continue
            if not isinstance(intent, RecoverIntent) or attempts[i] != 1 or self.export_spans or refused:
                alone[i] = self._one(env, attempts[i], refused)
                continue
            if not self.steps.owns(intent):
                continue
            key = self.key_of(intent)
            node = None if key in keys or key in self._locks else self._common_node(intent)
            if node is None:
                alone[i] = self._one(env, attempts[i])
                continue
            keys.add(key)
            items.append(_Item(i, intent, node, env.trace.traceparent, IntentProgress(key=key, incident_id=intent.incident_id)))
        return await beside(self._together(items, out), alone, out)

    async def _term_now(self, envs: list[Envelope]) -> int:
        """The controller's term now, if an intent here carries one (else 0, and no read)."""
        if not any(isinstance(env.data, RecoverIntent) and env.data.term for env in envs):
            return 0
        return await current_term(self.steps.store)

    def _refuse(self, intent: RecoverIntent, why: HoldfastError) -> None:
        """terms.py rule 1: logged, acked, nothing sent (no command, no result)."""
        self.refused += 1
        log.warning("intent %s of %s refused: %s: %s", self.key_of(intent), intent.engine_id, why.code, why.message)

    async def _one(self, env: Envelope, attempt: int, refused: HoldfastError | None = None) -> None:
        delivery_attempt.set(attempt)  # this coroutine runs as a task of its own (gather): its own context
        if self.export_spans and env.trace.traceparent:
            carrier = {"traceparent": env.trace.traceparent, **({"tracestate": env.trace.tracestate}
                                                                if env.trace.tracestate else {})}
            with telemetry.attach_headers(carrier):
                await self._alone(env, refused)
        else:
            await self._alone(env, refused)

    async def _alone(self, env: Envelope, refused: HoldfastError | None = None) -> None:
        """An intent stepped on its own from its recorded progress (read on a redelivery only). `refused`: its term
        has ended, so it goes on only from a record (accepted in its term: terms.py rule 2)."""
        intent = env.data
        assert isinstance(intent, RecoverIntent)
        if not self.steps.owns(intent):
            return
        key = self.key_of(intent)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            with self.steps.span("dc_manager.intent", {"holdfast.incident": intent.incident_id,
                                                       "holdfast.fallback": intent.memory_lost}):
                prog = await self.steps.load(key) if delivery_attempt.get() != 1 else None
                ran = prog is not None or refused is None
                if refused is not None and not ran:
                    self._refuse(intent, refused)
                else:
                    await self.steps.handle(intent, prog or IntentProgress(key=key, incident_id=intent.incident_id),
                                            env.trace.traceparent)
        self._locks.pop(key, None)
        if not ran:
            return
        self.steps.finished(key)
        self.handled += 1

    def _common_node(self, intent: RecoverIntent) -> str | None:
        """The node to reattach on when the intent is the batch's common case (see the module), else None."""
        if intent.memory_lost or not intent.node or intent.gang is not None:
            return None  # a TP group's freeze is FreezeGang's (steps.py)
        where = self.steps.in_place(intent)
        if where.action is not Action.REATTACH or self.steps.promote_early(intent, attempt=1):
            return None
        info = self.view.engines.get(intent.engine_id)
        if info is not None and info.successor_of and info.successor_of != intent.engine_id:
            return None  # a successor that may hold its predecessor's memory (`_freeze`'s hand-on)
        return where.node

    async def _together(self, items: list[_Item], out: list[BaseException | None]) -> None:
        if not items:
            return
        # keys checked free in this loop pass: nobody else holds them
        async with holding([self._locks.setdefault(item.prog.key, asyncio.Lock()) for item in items]):
            try:
                frozen = await self._freeze_all(items)
                await self._take_over_all(frozen, out)
            finally:
                for item in items:
                    if item.alone is not None:
                        try:
                            await item.alone
                        except Exception as e:  # noqa: BLE001 - redelivered
                            out[item.at] = e
                for item in items:
                    self._locks.pop(item.prog.key, None)
                    if out[item.at] is None:  # handled (a failed one is redelivered and needs its record)
                        self.steps.finished(item.prog.key)
                self.handled += len(items)

    async def _freeze_all(self, items: list[_Item]) -> list[_Item]:
        """Every item's freeze sent at once; those frozen have their progress recorded (awaited together) and are
        returned; the others go on alone (their freeze again, with retries; a typed error becomes a failed result)."""
        calls = [(item.node, Freeze(owner=item.intent.engine_id, incident_id=item.intent.incident_id), item.trace)
                 for item in items]
        t0 = time.perf_counter()
        frozen: list[_Item] = []
        async for got in self.bus.request_all(calls, FreezeReply, timeout=self.settings.freeze_timeout_s):
            now, ms = time.time(), round((time.perf_counter() - t0) * 1000.0, 3)
            for i, reply in got:
                item = items[i]
                if isinstance(reply, FreezeReply):
                    item.prog.freeze, item.prog.freeze_ms, item.prog.frozen_at = reply, ms, now
                    frozen.append(item)
                else:
                    self._go_alone(item)
        saved = await asyncio.gather(*(self.steps.save(item.prog) for item in frozen), return_exceptions=True)
        kept = []
        for item, error in zip(frozen, saved, strict=True):
            if isinstance(error, BaseException):
                item.prog.freeze = None  # not resumable from a record: it freezes again (the same token)
                self._go_alone(item)
            else:
                kept.append(item)
        return kept

    async def _take_over_all(self, items: list[_Item], out: list[BaseException | None]) -> None:
        """Every frozen item's takeover sent at once; the results of those answered in one loop pass published
        together; a takeover that fails goes on alone from the recorded freeze (sent again: idempotent)."""
        if not items:
            return
        loop = asyncio.get_running_loop()
        answered: set[int] = set()
        announcing: list[asyncio.Task[None]] = []

        def announce() -> None:  # the freeze's own result for every takeover still running (as one at a time)
            slow = [item for i, item in enumerate(items) if i not in answered]
            for item in slow:
                item.announced = True
            announcing.append(loop.create_task(self.steps.publish(
                [self.steps.freeze_result(item.intent, item.prog, item.trace) for item in slow])))

        calls = [(item.node, self.steps.takeover(item.intent, item.prog.freeze.transfer_token), item.trace)  # type: ignore[union-attr]
                 for item in items]
        t0 = time.perf_counter()
        timer = loop.call_later(self.settings.freeze_result_after_s, announce)
        try:
            wait = min(self.settings.takeover_attempt_s, self.settings.takeover_timeout_s)  # then alone, sent again
            async for got in self.bus.request_all(calls, TakeoverReply, timeout=wait):
                ms = round((time.perf_counter() - t0) * 1000.0, 3)
                done: list[_Item] = []
                for i, reply in got:
                    answered.add(i)
                    item = items[i]
                    if isinstance(reply, TakeoverReply):
                        item.prog.takeover, item.prog.takeover_ms = reply, ms
                        done.append(item)
                    else:
                        self._go_alone(item)
                if any(item.announced for item in done):
                    for task in announcing:
                        await task  # a freeze result goes before its reattach result
                try:
                    await self.steps.publish([self.steps.reattach_result(item.intent, item.prog, item.trace)
                                              for item in done])
                except Exception as e:  # noqa: BLE001 - each redelivered; its freeze is recorded
                    for item in done:
                        out[item.at] = e
        finally:
            timer.cancel()
            for task in announcing:
                try:
                    await task
                except Exception as e:  # noqa: BLE001 - a freeze result lost: redeliver those intents
                    for item in items:
                        if item.announced:
                            out[item.at] = e

    def _go_alone(self, item: _Item) -> None:
        """The item's intent goes on as one at a time would, from its progress, under the lock the batch holds."""
        async def go() -> None:
            delivery_attempt.set(1)
            await self.steps.handle(item.intent, item.prog, item.trace)

        item.alone = asyncio.get_running_loop().create_task(go())
