"""A takeover the node's agent received and then lost (killed mid-takeover, restarted by its supervisor a second
later) is sent again after `takeover_attempt_s`, not waited on for the whole 30 s while the frozen memory sits unused
and the controller's reattach deadline runs out (probe of 2026-12-07: a 33-58 s outage, a cold start instead of the
warm standby). The re-sent one is the same command (idempotent by incident): a live agent joins the first. A real
dc_manager process, NATS and etcd; the node's agent as responders that lose the first takeover."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from libs.common.bus import Bus
from libs.common.events import (
    RecoverIntent,
    Takeover,
    TakeoverReply,
)
from libs.common.store import Store
from tests.controller.helpers import healthy, service_env, start, wait_for
from tests.dc_manager.test_early_promotion import NODE, Node, _cluster, serve
from tests.support import intent_results


class ForgetfulNode(Node):
    """Answers freezes at once; the first takeover is received and never answered (its agent died), the next ones
    are, as `Node` answers them."""

    def __init__(self) -> None:
        super().__init__()
        self.release.set()
        self.sent: list[tuple[Takeover, float]] = []  # every takeover, answered or not, and when it came
        self.gone = asyncio.Event()  # never set: the first takeover's agent is dead

    async def takeover(self, cmd: Takeover) -> TakeoverReply:
        self.sent.append((cmd, time.monotonic()))
        if len(self.sent) == 1:
            await self.gone.wait()
        return await super().takeover(cmd)


async def test_a_lost_takeover_is_sent_again_within_its_attempt_not_after_the_whole_timeout(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    node = ForgetfulNode()
    await serve(bus, node)
    await _cluster(store, "e-lost", shadowed=False)
    dcm = start("services.dc_manager", service_env(settings_env, HF_TAKEOVER_ATTEMPT_S="1",
                                                   HF_TAKEOVER_TIMEOUT_S="30"), tmp_path / "dcm.log")
    try:
        await healthy(bus, "dc_manager", "dc-1")
        await bus.emit(RecoverIntent(incident_id="inc-lost", engine_id="e-lost", model="m", node=NODE))
        async def reattached() -> list | None:
            got = await intent_results(bus, "inc-lost") or []
            return got if any(r.step == "reattach" for r in got) else None

        got = await wait_for(reattached, timeout=15.0, what="the reattach's result")
        assert [(r.step, r.ok) for r in got] == [("freeze", True), ("reattach", True)], got  # the freeze's first
        (first, t1), (again, t2) = node.sent[:2]
        assert again == first and 0.9 <= t2 - t1 < 5.0  # the same command, after one attempt's wait
    finally:
        dcm.stop()
