"""A standby that shadows the failed engine is promoted while the freeze runs, with the token the freeze will
hold; any other standby is promoted only after the freeze (it maps the memory read-write)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from libs.common.bus import Bus
from libs.common.events import (
    EngineInfo,
    EngineRole,
    Freeze,
    FreezeReply,
    LeaseInfo,
    LeaseState,
    RecoverIntent,
    Tag,
    Takeover,
    TakeoverReply,
    engine_record_key,
)
from libs.common.store import Store
from tests.controller.helpers import healthy, service_env, start, wait_for
from tests.support import intent_results, put_node

NODE = "n-early"


class Node:
    """The node's freeze (held until `release`) and takeover responders, noting what came when."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.freezes: list[Freeze] = []
        self.takeovers: list[tuple[Takeover, bool]] = []  # (command, whether the freeze had answered then)
        self.answered = False

    async def freeze(self, cmd: Freeze) -> FreezeReply:
        self.freezes.append(cmd)
        await self.release.wait()
        self.answered = True
        return FreezeReply(lease_ids=[f"L-{cmd.owner}"], epoch=2, transfer_token=cmd.transfer_token or "t" * 32)

    async def takeover(self, cmd: Takeover) -> TakeoverReply:
        self.takeovers.append((cmd, self.answered))
        succ = EngineInfo(engine_id=f"{cmd.engine_id}-succ", node=NODE, model="m", engine_class="c",
                          role=EngineRole.ACTIVE, state="ready", endpoint="http://127.0.0.1:9/s")
        return TakeoverReply(engine=succ, used_standby=True)


async def serve(bus: Bus, node: Node) -> None:
    """`node` answers the node's freezes and takeovers."""
    await bus.serve(NODE, Freeze, node.freeze)
    await bus.serve(NODE, Takeover, node.takeover)


async def _cluster(store: Store, engine: str, *, shadowed: bool) -> None:
    await put_node(store, NODE)
    await store.put(engine_record_key(NODE, engine), EngineInfo(engine_id=engine, node=NODE, model="m", engine_class="c",
                                                    role=EngineRole.ACTIVE, state="ready"))
    await store.put(f"allocations/{NODE}/L-{engine}", LeaseInfo(
        id=f"L-{engine}", node=NODE, gpu=0, size=2**20, chunk_size=2**20, tag=Tag.WEIGHTS, owner=engine,
        engine_class="c", epoch=1, state=LeaseState.ACTIVE, created_at=time.time(), last_seen=time.time()))
    sb = f"{engine}-standby"
    await store.put(engine_record_key(NODE, sb), EngineInfo(engine_id=sb, node=NODE, model="m", engine_class="c",
                                                role=EngineRole.STANDBY, state="standby",
                                                shadows=engine if shadowed else None))


async def test_a_shadowing_standby_is_promoted_during_the_freeze_and_a_plain_one_after_it(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    node = Node()
    await serve(bus, node)
    await _cluster(store, "e-shadowed", shadowed=True)
    await _cluster(store, "e-plain", shadowed=False)
    dcm = start("services.dc_manager", service_env(settings_env, HF_PROMOTE_SHADOWS_EARLY="true"), tmp_path / "dcm.log")
    try:
        # The condition the view needs: the manager answers health only after its setup, which waits for its
        # view's first snapshot, read after the records above were written (the process starts after them).
        await healthy(bus, "dc_manager", "dc-1")
        await bus.emit(RecoverIntent(incident_id="inc-sh", engine_id="e-shadowed", model="m", node=NODE))

        async def promoted() -> bool:
            return bool(node.takeovers)

        await wait_for(promoted, what="the shadow's promotion while the freeze is held")
        takeover, freeze_had_answered = node.takeovers[0]
        assert not freeze_had_answered and len(node.freezes) == 1
        token = node.freezes[0].transfer_token
        assert token is not None and len(token) >= 16 and takeover.transfer_token == token
        node.release.set()
        got = await wait_for(lambda: intent_results(bus, "inc-sh"), what="the intent's result")
        assert [(r.step, r.ok) for r in got] == [("reattach", True)]
        assert got[0].timings_ms.get("promoted_during_freeze") == 1.0 and got[0].frozen_at is not None

        await bus.emit(RecoverIntent(incident_id="inc-plain", engine_id="e-plain", model="m", node=NODE))
        got = await wait_for(lambda: intent_results(bus, "inc-plain"), what="the plain standby's result")
        assert [(r.step, r.ok) for r in got] == [("reattach", True)]
        plain = [(t, answered) for t, answered in node.takeovers if t.engine_id == "e-plain"]
        assert plain and plain[0][1] is True  # only after the freeze answered
        assert node.freezes[-1].transfer_token is None  # the manager chose no token: the freeze's own holds
        assert "promoted_during_freeze" not in got[0].timings_ms
    finally:
        dcm.stop()
