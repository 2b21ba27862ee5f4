"""A step's deadline counts only the time the controller's bus was up (services/controller/bus_outages.py): a 7 s
NATS restart just after an engine's SIGKILL had its freeze's 5 s deadline missed the moment the bus came back, and a
cold-start fallback took the node's slot from the warm standby about to take over (probe of 2026-12-07). Pure."""

from __future__ import annotations

from services.controller.bus_outages import BusOutages


def test_the_time_the_bus_was_silent_is_counted_from_its_last_answer_and_an_outage_under_way_up_to_now() -> None:
    out = BusOutages(keep_s=100.0, silent_s=1.0)
    answered = 0.0
    for t in (0.0, 5.0, 10.0):  # answering
        answered = t
        out.observe(t, answered)
    for t in (10.5, 11.5, 16.9):  # silent since 10
        out.observe(t, answered)
    out.observe(17.0, 17.0)  # answers again: down from 10 to 17
    for t in (30.0, 31.5, 35.0):
        out.observe(t, 30.0)  # silent since 30
    assert out.down and out.down_within(0.0, 35.0) == 7.0 + 5.0
    assert out.down_within(12.0, 35.0) == 5.0 + 5.0  # the part of the first outage after 12
    assert out.down_within(20.0, 29.0) == 0.0
    out.observe(40.0, 40.0)
    assert not out.down and out.down_within(0.0, 40.0) == 17.0
    out.observe(200.0, 200.0)  # spans older than keep_s are forgotten
    assert out.down_within(0.0, 200.0) == 0.0


class _Steps:
    def __init__(self) -> None:
        self.missed: list[str] = []

    async def move_one(self, move) -> None:  # noqa: ANN001
        self.missed.append(move.inc_id)

    async def resume(self, inc_id: str) -> None:
        pass

    async def on_faults(self, envs: list) -> list:
        return []


class _Ends:
    doubts: dict = {}


async def test_a_freezes_deadline_is_pushed_by_the_time_the_bus_was_down() -> None:
    import asyncio

    from services.controller.deadline_pass import DeadlinePass
    from services.controller.incident import IncidentRecord, IncidentState
    from services.controller.incident_locks import IncidentLocks
    from services.controller.open_incidents import OpenIncidents
    from services.controller.view import ClusterView

    async def ping() -> bool:
        return True

    steps, open_ = _Steps(), OpenIncidents()
    open_.put(IncidentRecord(id="inc-1", engine_id="e", model="m", engine_class="c", node="n", gpu=0,
                             state=IncidentState.FREEZING, updated_at=100.0, deadline=105.0))
    dp = DeadlinePass(steps, open_, IncidentLocks(), ClusterView(), _Ends(), 0.1,  # type: ignore[arg-type]
                      bus_ping=ping)
    dp.answered_at = 101.0
    dp.tick(100.5)
    for t in (101.5, 104.0, 106.0, 108.0):  # silent from 101 to 108: nothing is judged missed meanwhile
        dp.tick(t)
    dp.answered_at = 108.0
    dp.tick(108.0)
    open_.put(open_.get("inc-1").model_copy(update={"updated_at": 108.1}))  # a step's record landed after it
    dp.answered_at = 111.0
    dp.tick(111.0)  # 11 s since its step began, 7 of them without a bus: 4 s of its 5 s budget
    await asyncio.sleep(0)
    assert steps.missed == []
    dp.answered_at = 112.5
    dp.tick(112.5)
    await asyncio.sleep(0)
    assert steps.missed == ["inc-1"]
    dp.cancel()


async def answers_again(bus) -> None:  # noqa: ANN001
    """Within 30 s (the server resumed: its PONGs to the PINGs of the stall come first, or nats-py reconnects)."""
    import asyncio

    from libs.common.bus import server_answers

    for _ in range(150):
        if await server_answers(bus.nc, 1.0):
            return
        await asyncio.sleep(0.2)
    raise AssertionError("the bus does not answer again")


async def test_a_stopped_nats_server_does_not_answer_the_controllers_ping(
        settings, nats_conf, tmp_path) -> None:  # noqa: ANN001
    """A SIGSTOPped server keeps the connection open and nats-py "connected": only a PING tells it is gone."""
    import os
    import signal

    from libs.common.bus import Bus, server_answers
    from tests.support import OwnNats

    server = OwnNats(tmp_path, nats_conf)
    child = server.child
    bus = await Bus.connect(settings.model_copy(update={"nats_url": server.url}), "test", stream=False)
    try:
        assert await server_answers(bus.nc, 1.0)
        os.kill(child.pid, signal.SIGSTOP)
        try:
            assert bus.nc.is_connected
            assert not await server_answers(bus.nc, 1.0)  # nats-py's flush times out
        finally:
            os.kill(child.pid, signal.SIGCONT)
        await answers_again(bus)
        # the late PONG of the PING that timed out did not end the connection's read loop (nats-py's flush leaves
        # its cancelled future queued: InvalidStateError there, and every later request timed out)
        reconnects = bus.nc.stats["reconnects"]
        sub = await bus.nc.subscribe(f"{bus.prefix}.after-stall")
        await bus.nc.publish(f"{bus.prefix}.after-stall", b"read")
        assert (await sub.next_msg(timeout=5)).data == b"read" and bus.nc.stats["reconnects"] == reconnects
    finally:
        await bus.close()
        child.stop()
