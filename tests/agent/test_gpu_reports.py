"""The agent's GPU health reports (services/agent/gpu_reports.py), pure logic over a scripted `send`: retried until
answered, the latest wish wins, a permanent refusal is not retried, every wish's future is resolved."""

from __future__ import annotations

import asyncio

from libs.common.errors import CommandTimeout, RemoteError, Unavailable
from libs.common.events import GpuRecord, SetGpuHealthReply
from services.agent.gpu_reports import GpuReports, retried


class Manager:
    """A scripted gpu_manager: raises the queued errors first, then answers; records what it was told."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.told: list[tuple[int, bool, str]] = []
        self.gate: asyncio.Event | None = None

    async def send(self, gpu: int, healthy: bool, detail: str) -> SetGpuHealthReply:
        if self.gate is not None:
            await self.gate.wait()
        if self.errors:
            raise self.errors.pop(0)
        self.told.append((gpu, healthy, detail))
        return SetGpuHealthReply(gpu=GpuRecord(node="n", gpu=gpu, healthy=healthy, detail=detail))


async def test_a_report_is_sent_again_until_the_manager_answers_it() -> None:
    mgr = Manager(Unavailable("no responders"), CommandTimeout("5 s"), RemoteError("internal", "db locked"))
    reports = GpuReports(mgr.send)
    reply = await asyncio.wait_for(reports.want(1, False, "XID 79"), 10)
    assert reply is not None and not reply.gpu.healthy and mgr.told == [(1, False, "XID 79")]
    assert reports.pending() == {}


async def test_a_permanent_refusal_is_given_up_and_its_future_says_none() -> None:
    mgr = Manager(RemoteError("not_found", "no GPU 7 on n"))
    reports = GpuReports(mgr.send)
    assert await asyncio.wait_for(reports.want(7, False, "XID 79"), 5) is None
    assert mgr.told == [] and reports.pending() == {}


async def test_the_latest_wish_is_what_the_manager_ends_up_holding_and_every_wish_is_answered() -> None:
    mgr = Manager(Unavailable("restarting"))
    mgr.gate = asyncio.Event()  # the first send is in flight while the next wishes come
    reports = GpuReports(mgr.send)
    first = reports.want(1, False, "XID 79")
    await asyncio.sleep(0)
    second, third = reports.want(1, True, ""), reports.want(1, False, "XID 48")
    assert reports.pending() == {1: False}
    mgr.gate.set()
    answers = await asyncio.wait_for(asyncio.gather(first, second, third), 10)
    assert mgr.told[-1] == (1, False, "XID 48")  # the older wishes were replaced before any was answered
    assert all(a is not None and a.gpu.detail == "XID 48" for a in answers)
    assert reports.pending() == {}


def test_only_a_refusal_for_good_is_not_retried() -> None:
    assert retried(Unavailable("x")) and retried(CommandTimeout("x")) and retried(OSError("x"))
    assert retried(RemoteError("internal", "x")) and not retried(RemoteError("not_found", "x"))
    assert not retried(RemoteError("permission_denied", "x"))
