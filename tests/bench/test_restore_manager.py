"""`bench restore --manager`: a health poll the gpu_manager answers late (its event loop stalled while it wrote the
tier copy) is a figure in the report, not the run's crash: the poll that timed out is counted and the next one goes
on, and the longest answer time is `health_max_ms`. A real NATS server; the responder stands in for a manager whose
first answer comes after the poll's bound."""

from __future__ import annotations

import asyncio
import json
import time
import types

from bench import restore_manager

STALL_S = 1.0


async def test_a_late_health_answer_is_counted_and_reported_not_a_crash(bus, settings, monkeypatch):
    monkeypatch.setattr(restore_manager, "HEALTH_TIMEOUT_S", 0.3)
    asked = []

    async def answer(msg) -> None:  # noqa: ANN001
        asked.append(time.perf_counter())
        if len(asked) == 1:
            await asyncio.sleep(STALL_S)  # callbacks of one subscription run one at a time: the next waits too
        tier = {"copies": [restore_manager.NAME], "registered_bytes": 0}
        await msg.respond(json.dumps({"detail": {"host_tier": tier}}).encode())

    sub = await bus.nc.subscribe(f"{settings.subject_prefix}.health.gpu_manager", cb=answer)
    await bus.settle()  # at the server before another connection asks
    stack = types.SimpleNamespace(settings=lambda: settings)
    try:
        out = await restore_manager._wait_copy(stack, 1, False, time.perf_counter(), timeout_s=30)
    finally:
        await sub.unsubscribe()
    assert out["held"] and out["health_timeouts"] >= 1
    assert out["health_max_ms"] >= 300  # a timed-out poll counts as long as it waited
    assert out["health_polls"] == out["health_timeouts"] + 1
