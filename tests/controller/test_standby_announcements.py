"""Routers are told each routed engine's shadowing standby (services/controller/standbys.py): which pairs the view
gives (pure), and what a pass sends over real NATS (changes at once, everything again at each refresh)."""

from __future__ import annotations

import asyncio

from libs.common.bus import Bus
from libs.common.events import EndpointStandby, EngineInfo, EngineRole, Envelope
from services.controller.standbys import StandbyAnnouncer, announcements
from services.controller.view import ClusterView


def engine(eid: str, node: str, role: EngineRole, state: str, endpoint: str | None,
           shadows: str | None = None) -> EngineInfo:
    return EngineInfo(engine_id=eid, node=node, model="m", engine_class="batched", role=role, state=state,
                      endpoint=endpoint, shadows=shadows)


def view_of(*engines: EngineInfo, routed: tuple[str, ...] = ()) -> ClusterView:
    view = ClusterView()
    for e in engines:
        view.apply("put", f"engines/{e.node}/{e.engine_id}", e.model_dump_json().encode())
    for eid in routed:
        url = next(e.endpoint for e in engines if e.engine_id == eid)
        view.apply("put", f"endpoints/m/{eid}", (url or "").encode())
    return view


A = engine("a", "n1", EngineRole.ACTIVE, "ready", "http://127.0.0.1:1001")
S = engine("s", "n1", EngineRole.STANDBY, "standby", "http://127.0.0.1:2001", shadows="a")


def test_a_routed_engine_with_a_standby_shadowing_it_on_its_node_is_announced_and_nothing_else() -> None:
    assert announcements(view_of(A, S, routed=("a",))) == {("m", "a"): ("s", "http://127.0.0.1:2001")}
    assert announcements(view_of(A, S)) == {}  # not routed (failing, or not ready yet)
    assert announcements(view_of(A, routed=("a",))) == {}  # nobody shadows it
    elsewhere = engine("s", "n2", EngineRole.STANDBY, "standby", "http://127.0.0.1:2001", shadows="a")
    assert announcements(view_of(A, elsewhere, routed=("a",))) == {}  # a shadow is of the engine's own node
    promoted = engine("s", "n1", EngineRole.ACTIVE, "ready", "http://127.0.0.1:2001", shadows="a")
    assert announcements(view_of(A, promoted, routed=("a",))) == {}  # no longer standing by


async def test_a_pass_sends_what_changed_and_a_refresh_sends_everything_again(bus: Bus) -> None:
    got: list[EndpointStandby] = []

    async def seen(env: Envelope) -> None:
        got.append(env.data)

    await bus.subscribe("router.endpoint.standby", seen)
    now = [0.0]
    view = view_of(A, S, routed=("a",))
    announcer = StandbyAnnouncer(bus, view, period_s=0.5, refresh_s=30.0, clock=lambda: now[0])

    async def sent(n: int) -> None:
        for _ in range(200):
            if len(got) >= n:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # and no more
        assert len(got) == n, got

    await announcer.once()
    await sent(1)
    assert (got[0].engine_id, got[0].standby_id, got[0].standby_url) == ("a", "s", "http://127.0.0.1:2001")
    now[0] = 1.0
    await announcer.once()  # nothing changed, no refresh due: nothing sent
    await sent(1)
    s2 = engine("s2", "n1", EngineRole.STANDBY, "standby", "http://127.0.0.1:2002", shadows="a")
    view.apply("delete", "engines/n1/s", None)
    view.apply("put", "engines/n1/s2", s2.model_dump_json().encode())
    await announcer.once()  # another standby: sent at once
    await sent(2)
    assert got[1].standby_id == "s2"
    now[0] = 31.0
    await announcer.once()  # the refresh: every pair again (a router started since learns it)
    await sent(3)
    assert announcer.announced == 3
