"""A command that reaches its service after its caller stopped waiting is refused, never run (libs/common/bus
commands.py `EXPIRY_SLACK_S`). Found by the fault sweep: a service resumed from SIGSTOP ran every command queued in
its socket meanwhile, though each caller had long taken the silence as a timeout and gone on (a retry, another
step): a freeze of a lease its owner is still using, a reclaim, a stop, acted on late.

Real nats-server and gpu_manager (host backend); the manager stopped with SIGSTOP and resumed with SIGCONT."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from libs.common.bus import Bus, codec
from libs.common.bus.commands import EXPIRY_SLACK_S
from libs.common.errors import CommandTimeout
from libs.common.events import Freeze, FreezeReply, LeaseState, ListLeases, ListLeasesReply, command_subject


async def test_a_freeze_sent_while_the_manager_was_stopped_is_not_run_when_it_resumes(manager, engines, bus) -> None:
    owner = engines(manager, "eng-busy")
    owner.ask(f"write {1 << 20} 5")
    before = (await bus.request("node-1", ListLeases(owner="eng-busy"), ListLeasesReply)).leases
    assert [lease.state for lease in before] == [LeaseState.ACTIVE]
    os.kill(manager.pid, signal.SIGSTOP)
    try:
        with pytest.raises(CommandTimeout):
            await bus.request("node-1", Freeze(owner="eng-busy"), FreezeReply, timeout=1.0)
        await asyncio.sleep(EXPIRY_SLACK_S + 0.5)  # the caller gave up a slack ago
    finally:
        os.kill(manager.pid, signal.SIGCONT)
    # the queued freeze is read first once it runs again, but answered in a task of its own: a listing sent at once
    # could be answered before it ran (without the refusal it did run, within this second)
    await asyncio.sleep(1.0)
    after = (await bus.request("node-1", ListLeases(owner="eng-busy"), ListLeasesReply, timeout=10)).leases
    assert [(lease.id, lease.state, lease.epoch) for lease in after] == [(before[0].id, LeaseState.ACTIVE, before[0].epoch)]
    assert owner.ask("hash")  # the owner still reads its memory
    # and one its caller still waits for is run as ever
    frozen = await bus.request("node-1", Freeze(owner="eng-busy"), FreezeReply)
    assert frozen.lease_ids == [before[0].id]


async def test_an_expired_command_is_answered_expired_and_its_handler_never_runs(bus: Bus) -> None:
    ran: list[ListLeases] = []

    async def handler(cmd: ListLeases) -> ListLeasesReply:
        ran.append(cmd)
        return ListLeasesReply(leases=[])

    await bus.serve("n-exp", ListLeases, handler)
    assert (await bus.request("n-exp", ListLeases(), ListLeasesReply)).leases == [] and len(ran) == 1
    subject = command_subject(bus.link.prefix, "n-exp", ListLeases)
    late = codec.command_body(ListLeases(), source="test", to="n-exp", traceparent=None, tracestate=None,
                              timeout_s=-(EXPIRY_SLACK_S + 1.0))  # its caller stopped waiting a slack and 1 s ago
    reply = await bus.link.nc.request(subject, late, timeout=5)
    assert b'"expired"' in reply.data and len(ran) == 1
    within = codec.command_body(ListLeases(), source="test", to="n-exp", traceparent=None, tracestate=None,
                                timeout_s=-(EXPIRY_SLACK_S - 2.0))  # late, but within the clocks' slack: run
    await bus.link.nc.request(subject, within, timeout=5)
    assert len(ran) == 2
