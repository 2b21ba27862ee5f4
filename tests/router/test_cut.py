"""A relayed stream's read is cut at once when its endpoint is removed, fails after `token_timeout_s` of
silence, and otherwise hands on each line and the stream's end (services/router/relay.py `Cut`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.router.relay import Cut, UpstreamFailed


async def _upstream(lines: list[str], then_wait: bool) -> AsyncIterator[str]:
    for line in lines:
        yield line
    if then_wait:
        await asyncio.Event().wait()  # an engine that says nothing more


async def test_lines_and_the_end_are_handed_on() -> None:
    cut, up = Cut(), _upstream(["a", "b"], then_wait=False)
    assert [await cut.next_line(up, 5), await cut.next_line(up, 5)] == ["a", "b"]
    with pytest.raises(StopAsyncIteration):
        await cut.next_line(up, 5)


async def test_a_read_waiting_on_a_silent_engine_ends_when_its_endpoint_is_removed() -> None:
    cut, up = Cut(), _upstream(["a"], then_wait=True)
    assert await cut.next_line(up, 60) == "a"
    asyncio.get_running_loop().call_later(0.05, cut.fire)
    with pytest.raises(UpstreamFailed, match="endpoint removed"):
        await asyncio.wait_for(cut.next_line(up, 60), 10)  # long before the silence bound
    with pytest.raises(UpstreamFailed, match="endpoint removed"):
        await cut.next_line(up, 60)  # and every read after it


async def test_silence_past_the_bound_fails_the_stream_and_a_cancelled_reader_stays_cancelled() -> None:
    cut = Cut()
    with pytest.raises(UpstreamFailed, match="no token for 0.05s"):
        await cut.next_line(_upstream([], then_wait=True), 0.05)
    reader = asyncio.create_task(Cut().next_line(_upstream([], then_wait=True), 60))
    await asyncio.sleep(0.02)
    reader.cancel()  # the client went away: a cancellation, not a failure to replay
    with pytest.raises(asyncio.CancelledError):
        await reader
