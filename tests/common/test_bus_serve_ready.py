"""`Bus.serve` returns only once the server routes the command to it: a request sent from another connection right
after it is answered, never refused with "no responders". nats-py's flush writes its PING straight to the socket
while the SUB may still wait in its pending buffer, so one round trip did not prove it (a flaky
test_security_nats.py case, traced in nats-server's log: the SUB reached the server after the other connection's
request)."""

from __future__ import annotations

from typing import Any

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import Freeze, FreezeReply


async def test_a_request_sent_as_soon_as_serve_returns_is_answered(settings: CommonSettings, bus: Bus) -> None:
    served = await Bus.connect(settings, "test-served", stream=False)  # admin: may serve any node
    answered = 0

    async def handler(cmd: Any) -> FreezeReply:
        return FreezeReply(lease_ids=[], epoch=1, transfer_token="t")

    try:
        for i in range(60):  # a fresh subject each time: each serve's SUB must be in place before it returns
            node = f"node-{i}"
            sub = await served.serve(node, Freeze, handler)
            await bus.request(node, Freeze(owner="e1"), FreezeReply, timeout=2)
            answered += 1
            await sub.unsubscribe()
    finally:
        await served.close()
    assert answered == 60
