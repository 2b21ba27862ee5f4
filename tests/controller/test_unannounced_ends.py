"""An incident whose terminal record is in etcd always has its end announced, even when the write that put it
there timed out at the client (issue 18, the defect left by "an end is announced only once recorded").

The ambiguous write, as a slow network makes it: the leader's etcd connection goes through `ReplyHold`, a TCP
relay that passes requests on at once but can hold etcd's answers. The terminal record's transaction reaches etcd,
which applies it, while its answer is held past the client's 5 s timeout: the write "fails" and has landed. Then:
- the same leader, once etcd answers again, reads the record back and announces the end (its deadline pass);
- a leader that stepped down first leaves it to the next, which announces it when it takes over.
Real etcd and NATS (the session's), the leader's pipeline in this process (`IncidentDriver`), fenced by a key.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import IncidentFailed, IncidentResolved
from libs.common.store import Store
from services.controller.announced_ends import Ledger
from services.controller.incident import (
    IncidentRecord,
    IncidentState,
    Trigger,
    apply,
    opened_record,
)
from services.controller.metrics import ControllerMetrics
from services.controller.pipeline import IncidentDriver
from services.controller.settings import ControllerSettings
from services.controller.view import ClusterView
from tests.controller.helpers import wait_for
from tests.controller.test_ended_incidents import FENCE, ends_heard, in_fallback, in_fallback_here
from tests.controller.test_open_incidents import D

CLIENT_TIMEOUT_S = 5.0  # the etcd client's per-call timeout (libs/common/store.py, `Store.connect`)


class ReplyHold:
    """A loopback TCP relay to etcd: what the client sends goes on at once; what etcd answers is held while
    `hold()` is on (a partition in one direction, as a congested or flapping link makes one). `cut()`: every
    connection is closed before it passes on another byte (a link that drops), until `mend()`."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.cutting = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        self.flowing.clear()

    def release(self) -> None:
        self.flowing.set()

    def cut(self) -> None:
        self.cutting = True

    def mend(self) -> None:
        self.cutting = False

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        etcd_r, etcd_w = await asyncio.open_connection(*self.target)
        for src, dst, held in ((client_r, etcd_w, False), (etcd_r, client_w, True)):
            task = asyncio.create_task(self._pump(src, dst, held))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, held: bool) -> None:
        try:
            while data := await src.read(65536):
                if held:
                    await self.flowing.wait()
                if self.cutting:
                    break  # dropped, and the connection with it
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()


@pytest.fixture
async def relay(settings: CommonSettings) -> AsyncIterator[ReplyHold]:
    r = ReplyHold(settings.etcd_endpoints)
    await r.start()
    yield r
    r.release()
    await r.close()


@pytest.fixture
async def slow_store(settings: CommonSettings, relay: ReplyHold) -> AsyncIterator[Store]:
    """The leader's etcd client, through the relay."""
    s = await Store.connect(settings.model_copy(update={"etcd_endpoints": f"127.0.0.1:{relay.port}"}))
    yield s
    await s.close()


def new_driver(bus: Bus, store: Store, settings: CommonSettings) -> IncidentDriver:
    view = ClusterView()
    conf = ControllerSettings(**settings.model_dump(), instance="c-test", api_enabled=False, record_linger_s=0.0)
    return IncidentDriver(bus, store, view, conf, ControllerMetrics(view, lambda: True),
                          fence=lambda t: [t.value(store.full(FENCE)) == b"held"])


def hold_replies_to_the_end_of(driver: IncidentDriver, relay: ReplyHold, inc_id: str,
                               fault: Callable[[], None] | None = None) -> asyncio.Event:
    """From the moment the incident's terminal record is sent, etcd's answers are held (or `fault` is done).
    Returns: set then."""
    held = asyncio.Event()
    sent: Callable[[str, bytes | None, Any], None] | None = driver.writer.on_send

    def on_send(key: str, value: bytes | None, obj: Any) -> None:
        if sent is not None:
            sent(key, value, obj)
        if key == f"incidents/{inc_id}" and isinstance(obj, IncidentRecord) and obj.terminal and not held.is_set():
            (fault or relay.hold)()
            held.set()

    driver.writer.on_send = on_send
    return held


async def end_written_but_timed_out(driver: IncidentDriver, relay: ReplyHold, store: Store,
                                    engine_id: str) -> IncidentRecord:
    """An incident of `driver` ends (its cold successor ready); its resolved record reaches etcd, and the answer
    comes after the client gave up. Returns the record as it was before (fallback)."""
    rec, cold = await in_fallback_here(driver, store, engine_id)
    held = hold_replies_to_the_end_of(driver, relay, rec.id)
    with pytest.raises(Exception):  # noqa: B017, PT011 - the client's timeout, whatever its type: redelivered
        await asyncio.wait_for(driver.trigger(rec.id, Trigger.SPAWNED, states=frozenset({IncidentState.FALLBACK}),
                                              successor_id=cold, successor_endpoint="http://127.0.0.1:1"),
                               CLIENT_TIMEOUT_S + 10)
    assert held.is_set()
    return rec


async def resolved_in_etcd(store: Store, inc_id: str) -> IncidentRecord | None:
    got = await store.get_model(f"incidents/{inc_id}", IncidentRecord)
    return got if got is not None and got.state is IncidentState.RESOLVED else None


async def resolved_heard(bus: Bus, inc_id: str) -> list[Any]:
    return [e for e in await ends_heard(bus) if isinstance(e.data, IncidentResolved) and e.data.incident_id == inc_id]


async def test_an_end_whose_write_timed_out_but_landed_is_announced_once_etcd_answers(
        bus: Bus, store: Store, slow_store: Store, relay: ReplyHold, settings: CommonSettings) -> None:
    await store.put(FENCE, "held")
    driver = new_driver(bus, slow_store, settings)
    deadlines = asyncio.create_task(driver.run_deadlines())  # the leader's level-triggered pass
    try:
        rec = await end_written_but_timed_out(driver, relay, slow_store, "e1")
        assert await resolved_in_etcd(store, rec.id) is not None  # the write landed (read past the relay)
        assert await resolved_heard(bus, rec.id) == []  # ...and its end was not announced with it
        relay.release()  # etcd answers again
        await wait_for(lambda: resolved_heard(bus, rec.id), timeout=5.0, what="incident.resolved announced")
        await asyncio.sleep(0.5)
        assert len(await resolved_heard(bus, rec.id)) == 1
    finally:
        deadlines.cancel()
        await asyncio.gather(deadlines, return_exceptions=True)
        await driver.stop()


async def test_a_new_leader_announces_an_end_recorded_but_never_announced(
        bus: Bus, store: Store, slow_store: Store, relay: ReplyHold, settings: CommonSettings) -> None:
    await store.put(FENCE, "held")
    first = new_driver(bus, slow_store, settings)
    rec = await end_written_but_timed_out(first, relay, slow_store, "e2")
    relay.release()
    await first.stop()  # it steps down before its deadline pass ran: it announced nothing
    assert await resolved_in_etcd(store, rec.id) is not None
    assert await resolved_heard(bus, rec.id) == []

    second = new_driver(bus, store, settings)  # the next term, whoever leads it
    try:
        await second.start()
        await wait_for(lambda: resolved_heard(bus, rec.id), timeout=5.0, what="incident.resolved announced")
    finally:
        await second.stop()


async def test_an_announced_end_is_in_a_ledger_and_the_next_leader_has_none_to_announce(
        bus: Bus, store: Store, settings: CommonSettings) -> None:
    """That an end is announced is recorded once it is (a ledger naming it; the record is not written again): a new
    leader finds none to announce (a second publication would only be dropped by JetStream's duplicate window while
    it lasts)."""
    await store.put(FENCE, "held")
    first = new_driver(bus, store, settings)
    rec, cold = await in_fallback_here(first, store, "e3")
    await first.trigger(rec.id, Trigger.SPAWNED, states=frozenset({IncidentState.FALLBACK}), successor_id=cold,
                        successor_endpoint="http://127.0.0.1:1")
    await first.stop()  # a clean stop writes what it queued
    got = await resolved_in_etcd(store, rec.id)
    assert got is not None and got.end_unannounced  # final as written: the ledger says it is announced
    ledgers = [Ledger.model_validate_json(raw).incidents for raw in (await store.get_prefix("announced/")).values()]
    assert ledgers == [[rec.id]]
    assert (await new_driver(bus, store, settings).log.to_take_over()).unannounced == []
    assert len(await resolved_heard(bus, rec.id)) == 1


async def test_an_end_whose_write_never_landed_is_resumed_and_ends_once_etcd_answers(
        bus: Bus, store: Store, slow_store: Store, relay: ReplyHold, settings: CommonSettings) -> None:
    """A fallback past its deadline fails (the leader's deadline pass: no message to redeliver); that record's
    write is lost with the connection. The incident is still in fallback in etcd: resumed, it fails again."""
    await store.put(FENCE, "held")
    driver = new_driver(bus, slow_store, settings)
    rec = in_fallback("e4", None).model_copy(update={"deadline": 0.0})  # its deadline long missed
    await slow_store.put(f"incidents/{rec.id}", rec)
    cut = hold_replies_to_the_end_of(driver, relay, rec.id, fault=relay.cut)
    driver.open.put(rec)
    deadlines = asyncio.create_task(driver.run_deadlines())
    try:
        await asyncio.wait_for(cut.wait(), 5.0)
        await asyncio.sleep(0.5)  # the write fails with its connection
        relay.mend()

        async def failed_heard() -> list[Any]:
            return [e for e in await ends_heard(bus) if isinstance(e.data, IncidentFailed)
                    and e.data.incident_id == rec.id]

        await wait_for(failed_heard, timeout=10.0, what="incident.failed announced")
        got = await store.get_model(f"incidents/{rec.id}", IncidentRecord)
        assert got is not None and got.state is IncidentState.FAILED
    finally:
        deadlines.cancel()
        await asyncio.gather(deadlines, return_exceptions=True)
        await driver.stop()


def test_every_end_is_marked_unannounced_by_the_transition_that_ends_it() -> None:
    rec = apply(opened_record(id="i", engine_id="e", opened_at=0.0), Trigger.DISPATCHED_FALLBACK, 0.0, D)
    assert not rec.end_unannounced
    for end in (apply(rec, Trigger.DEADLINE_MISSED, 1.0, D),
                apply(apply(rec, Trigger.SPAWNED, 1.0, D, successor_id="s"), Trigger.ROUTED_IN, 2.0, D)):
        assert end.terminal and end.end_unannounced
