"""The agent's record writer while etcd refuses writes (away, or full: its NOSPACE alarm holds for minutes): it
keeps the order and retries, backed off (0.2 s doubling to 5 s), saying so once a key, not a warning and a write
every 200 ms (probe of 2026-12-07). Pure logic over a store that refuses a given number of writes."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from libs.common.events import EngineSpec
from services.agent.records import RecordWriter


class RefusingStore:
    def __init__(self, refusals: int) -> None:
        self.refusals, self.tries, self.puts = refusals, [], []

    async def put(self, key: str, value: object) -> None:
        self.tries.append(time.monotonic())
        if len(self.tries) <= self.refusals:
            raise RuntimeError("etcdserver: mvcc: database space exceeded")
        self.puts.append(key)

    async def delete(self, key: str) -> None:
        self.puts.append(key)


async def test_a_refused_write_is_retried_backed_off_in_order_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    store = RefusingStore(refusals=4)
    writer = RecordWriter(store)  # type: ignore[arg-type]
    spec = EngineSpec(model="m", command=["true"])
    writer.put_spec("n1", "a", spec)
    writer.put_spec("n1", "b", spec)
    task = asyncio.create_task(writer.run())
    try:
        with caplog.at_level(logging.INFO, logger="holdfast"):
            await asyncio.wait_for(writer.flushed(), 10)
    finally:
        task.cancel()
    assert store.puts == ["agents/n1/specs/a", "agents/n1/specs/b"]  # in order, the second after the first
    gaps = [b - a for a, b in zip(store.tries, store.tries[1:5], strict=False)]
    assert all(later > earlier for earlier, later in zip(gaps, gaps[1:], strict=False)), gaps  # backed off
    said = [r.getMessage() for r in caplog.records if "etcd write of agents/n1/specs/a" in r.getMessage()]
    assert len(said) == 2 and "failed tries" in said[1], said  # one warning, one line when it went through
