"""Several dc_managers of one datacenter share its durable consumer: each intent reaches exactly one."""

from __future__ import annotations

import asyncio
from collections import Counter

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import Envelope, RecoverIntent


async def test_two_managers_bound_to_one_durable_split_the_intents_without_duplicates(settings: CommonSettings,
                                                                                    bus: Bus) -> None:
    seen: Counter[str] = Counter()
    by: dict[str, set[str]] = {"a": set(), "b": set()}
    done = asyncio.Event()

    def handler(who: str):  # type: ignore[no-untyped-def]
        async def on_intent(env: Envelope) -> None:
            assert isinstance(env.data, RecoverIntent)
            seen[env.data.incident_id] += 1
            by[who].add(env.data.incident_id)
            await asyncio.sleep(0.01)  # overlap: both managers are busy at once
            if len(seen) == 60:
                done.set()
        return on_intent

    managers = [await Bus.connect(settings, f"dcm-{w}") for w in by]
    try:
        for who, m in zip(by, managers, strict=True):
            await m.durable("intent.recover", "dc_manager-dc1", handler(who), concurrency=8, ack_wait=5, shared=True)
        for i in range(60):
            await bus.emit(RecoverIntent(incident_id=f"inc-{i}", engine_id=f"e{i}", model="m"))
        await asyncio.wait_for(done.wait(), 20)
        await asyncio.sleep(0.3)  # a duplicate would arrive now
        assert set(seen) == {f"inc-{i}" for i in range(60)}
        assert max(seen.values()) == 1
        assert by["a"] and by["b"], "both managers took a share"
    finally:
        for m in managers:
            await m.close()
