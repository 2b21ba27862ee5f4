"""A step's deadline counts only the time the controller's bus was up (services/controller/bus_outages.py): a 7 s
NATS restart just after an engine's SIGKILL had its freeze's 5 s deadline missed the moment the bus came back, and a
cold-start fallback took the node's slot from the warm standby about to take over (probe of 2026-12-07). Pure."""

from __future__ import annotations

from services.controller.bus_outages import BusOutages


def test_the_time_the_bus_was_down_is_counted_between_two_moments_and_an_outage_under_way_up_to_now() -> None:
    out = BusOutages(keep_s=100.0)
    for t, up in ((0.0, True), (10.0, False), (10.1, False), (17.0, True), (30.0, False)):
        out.observe(t, up)
    assert out.down and out.down_within(0.0, 35.0) == 7.0 + 5.0
    assert out.down_within(12.0, 35.0) == 5.0 + 5.0  # the part of the first outage after 12
    assert out.down_within(20.0, 29.0) == 0.0
    out.observe(40.0, True)
    assert not out.down and out.down_within(0.0, 40.0) == 17.0
    out.observe(200.0, True)  # spans older than keep_s are forgotten
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

    steps, open_, up = _Steps(), OpenIncidents(), [True]
    open_.put(IncidentRecord(id="inc-1", engine_id="e", model="m", engine_class="c", node="n", gpu=0,
                             state=IncidentState.FREEZING, updated_at=100.0, deadline=105.0))
    dp = DeadlinePass(steps, open_, IncidentLocks(), ClusterView(), _Ends(), 0.1,  # type: ignore[arg-type]
                      connected=lambda: up[0])
    dp.tick(100.5)
    up[0] = False
    for t in (101.0, 104.0, 106.0, 108.0):  # down from 101 to 108: nothing is judged missed meanwhile
        dp.tick(t)
    up[0] = True
    dp.tick(108.0)
    open_.put(open_.get("inc-1").model_copy(update={"updated_at": 108.1}))  # a step's record landed after it
    dp.tick(111.0)  # 11 s since its step began, 7 of them without a bus: 4 s of its 5 s budget
    await asyncio.sleep(0)
    assert steps.missed == []
    dp.tick(112.5)
    await asyncio.sleep(0)
    assert steps.missed == ["inc-1"]
    dp.cancel()
