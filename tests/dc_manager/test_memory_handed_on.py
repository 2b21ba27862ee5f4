"""A shadow promoted while the freeze ran (it serves at once, owns the leases only once its predecessor is dead)
that dies before it owned them: its incident's freeze finds nothing of its own, so the dc_manager hands on
its predecessor's leases, still frozen under their first token, to the next successor (Takeover.memory_of)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from libs.common.bus import Bus
from libs.common.errors import NotFound
from libs.common.events import (
    EngineInfo,
    EngineRole,
    Freeze,
    FreezeReply,
    IntentResult,
    RecoverIntent,
    Takeover,
    TakeoverReply,
)
from libs.common.store import Store
from tests.controller.helpers import healthy, service_env, start, wait_for

NODE = "n-handed-on"
TOKEN = "first-token-" + "x" * 20


class Node:
    """The node side: the first engine's leases frozen under TOKEN; its successor holds none."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.freezes: list[str] = []
        self.takeovers: list[Takeover] = []

    async def freeze(self, cmd: Freeze) -> FreezeReply:
        self.freezes.append(cmd.owner)
        if cmd.owner != self.owner:
            raise NotFound(f"{cmd.owner} holds no live leases on {NODE}")
        return FreezeReply(lease_ids=[f"L-{cmd.owner}"], epoch=2, transfer_token=TOKEN)  # frozen already: its token

    async def takeover(self, cmd: Takeover) -> TakeoverReply:
        self.takeovers.append(cmd)
        succ = EngineInfo(engine_id="third", node=NODE, model="m", engine_class="c", role=EngineRole.ACTIVE,
                          state="ready", endpoint="http://127.0.0.1:9/third", successor_of=cmd.memory_of)
        return TakeoverReply(engine=succ, used_standby=True)


async def _results(bus: Bus, incident: str) -> list[IntentResult] | None:
    got = [e.data for e in await bus.replay("intent.result")
           if isinstance(e.data, IntentResult) and e.data.incident_id == incident]
    return got or None


async def _cluster(store: Store, **engines: str | None) -> None:
    await store.put(f"nodes/{NODE}", {"node": NODE, "datacenter": "dc-1", "started_at": time.time(), "gpus": [0]})
    await store.put(f"gpus/{NODE}/0", {"healthy": True, "total_bytes": 10 * 2**30})
    for engine, successor_of in engines.items():
        await store.put(f"engines/{engine}", EngineInfo(engine_id=engine, node=NODE, model="m", engine_class="c",
                                                        role=EngineRole.ACTIVE, state="ready",
                                                        successor_of=successor_of))


async def test_a_successor_that_died_before_owning_its_memory_has_its_predecessors_frozen_leases_handed_on(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    node = Node(owner="first")
    await bus.serve(NODE, Freeze, node.freeze)
    await bus.serve(NODE, Takeover, node.takeover)
    await _cluster(store, first=None, second="first", plain=None)
    dcm = start("services.dc_manager", service_env(settings_env), tmp_path / "dcm.log")
    try:
        await healthy(bus, "dc_manager", "dc-1")

        await asyncio.sleep(0.5)  # the manager's view has the engines (a watch, not a read, feeds it)
        await bus.emit(RecoverIntent(incident_id="inc-second", engine_id="second", model="m", node=NODE))
        got = await wait_for(lambda: _results(bus, "inc-second"), what="the second incident's result")
        assert [(r.step, r.ok) for r in got] == [("reattach", True)] and got[0].successor_id == "third"
        assert node.freezes == ["second", "first"]
        (takeover,) = node.takeovers
        assert (takeover.engine_id, takeover.memory_of, takeover.transfer_token) == ("second", "first", TOKEN)

        # An engine that is no one's successor and holds nothing: its freeze fails as before (the fallback).
        await bus.emit(RecoverIntent(incident_id="inc-plain", engine_id="plain", model="m", node=NODE))
        got = await wait_for(lambda: _results(bus, "inc-plain"), what="the plain engine's result")
        assert [(r.step, r.ok) for r in got] == [("freeze", False)] and "not_found" in got[0].detail
        assert len(node.takeovers) == 1
    finally:
        dcm.stop()
