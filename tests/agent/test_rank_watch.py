"""A TP group's followers watched through the agent's own pidfds (services/agent/rank_watch.py): real processes and
real signals for the watch, plain values for the pure parts (the registration's `followers`, the fault's detail)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from libs.common.errors import MalformedMessage
from libs.common.events import FaultKind, RankProcess
from services.agent.pidfd import ExitStatus, proc_start_time
from services.agent.rank_watch import RankWatch, death_fault, parse_followers

Death = tuple[str, RankProcess, ExitStatus | None, str]


def _sleeper() -> subprocess.Popen[bytes]:
    """A process that is the test's child, as a follower is rank 0's: not reaped until the test waits for it."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_followers_a_group_registers_with_are_its_ranks_one_to_n_minus_one() -> None:
    raw = [{"rank": 2, "pid": 12, "pid_start": 7}, {"rank": 1, "pid": 11}]
    assert parse_followers(raw, 3) == [RankProcess(rank=1, pid=11), RankProcess(rank=2, pid=12, pid_start=7)]
    for bad in ([{"rank": 1, "pid": 11}], [{"rank": 1, "pid": 11}] * 2 + [{"rank": 2, "pid": 3}],
                [{"rank": 0, "pid": 11}, {"rank": 1, "pid": 12}], [{"rank": 1, "pid": "x"}, {"rank": 2, "pid": 3}],
                {"1": 11}):
        with pytest.raises(MalformedMessage):
            parse_followers(bad, 3)


def test_a_followers_fault_names_its_rank_engine_id_and_pid() -> None:
    rank = RankProcess(rank=1, pid=4242)
    kind, detail = death_fault("g", rank, ExitStatus(pid=4242, at=0.0, known=True, signal=signal.SIGKILL), "its pidfd")
    assert kind is FaultKind.KILLED
    assert detail == "rank 1 (g-r1, pid 4242) of the group died: signal SIGKILL (its pidfd)"
    kind, detail = death_fault("g", rank, ExitStatus(pid=4242, at=0.0, known=True, exit_code=3), "seen exiting")
    assert kind is FaultKind.EXITED and detail.endswith("exited: exit code 3 (seen exiting)")
    assert "status unknown" in death_fault("g", rank, ExitStatus(pid=4242, at=0.0, known=False), "its pidfd")[1]
    assert death_fault("g", rank, None, "gone")[1] == "rank 1 (g-r1, pid 4242) of the group was gone (gone)"


async def test_a_sigkilled_follower_is_reported_once_through_its_pidfd_with_its_signal() -> None:
    deaths: asyncio.Queue[Death] = asyncio.Queue()
    watch = RankWatch(lambda *d: deaths.put_nowait(d))
    one, two = _sleeper(), _sleeper()
    try:
        watched, gone = watch.watch("g", [RankProcess(rank=1, pid=one.pid), RankProcess(rank=2, pid=two.pid)])
        assert gone == [] and [r.pid_start for r in watched] == [proc_start_time(one.pid), proc_start_time(two.pid)]
        os.kill(one.pid, signal.SIGKILL)
        group, rank, st, how = await asyncio.wait_for(deaths.get(), 10)
        # not the watcher's child, but its zombie (not reaped yet by its parent, here the test) still holds the status
        assert (group, rank.rank, rank.pid, how) == ("g", 1, one.pid, "its pidfd")
        assert st is not None and st.known and st.signal == signal.SIGKILL
        watch.forget("g")  # what the agent does at the first death
        os.kill(two.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)
        assert deaths.empty() and watch.watching("g") == []
    finally:
        for p in (one, two):
            p.kill()
            p.wait(10)
        watch.close()


async def test_a_follower_already_reaped_or_under_a_recycled_pid_is_gone() -> None:
    watch = RankWatch(lambda *d: None)
    reaped, alive = _sleeper(), _sleeper()
    start = proc_start_time(reaped.pid)
    reaped.kill()
    reaped.wait(10)
    try:
        recycled = RankProcess(rank=2, pid=alive.pid, pid_start=(proc_start_time(alive.pid) or 0) - 1)
        watched, gone = watch.watch("g", [RankProcess(rank=1, pid=reaped.pid, pid_start=start), recycled])
        assert watched == [] and [r.rank for r in gone] == [1, 2]
    finally:
        alive.kill()
        alive.wait(10)
        watch.close()


async def test_a_dead_follower_is_found_at_once_when_rank_0s_exit_comes_first() -> None:
    """Rank 0's exit 70 handled before the loop came to the follower's pidfd (a busy loop: both ready in one pass):
    `dead_follower` looks now, whether the follower is still a zombie or already reaped by its parent."""
    deaths: asyncio.Queue[Death] = asyncio.Queue()
    watch = RankWatch(lambda *d: deaths.put_nowait(d))
    one, two, three = _sleeper(), _sleeper(), _sleeper()
    try:
        watch.watch("g", [RankProcess(rank=1, pid=one.pid), RankProcess(rank=2, pid=two.pid)])
        watch.watch("h", [RankProcess(rank=1, pid=three.pid)])
        assert watch.dead_follower("g") is None  # all alive
        os.kill(two.pid, signal.SIGKILL)
        while os.waitid(os.P_PID, two.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            time.sleep(0.001)  # a zombie now; no loop pass has run since the kill (no await)
        hit = watch.dead_follower("g")
        assert hit is not None and hit[0].rank == 2 and hit[1].signal == signal.SIGKILL, hit
        assert watch.dead_follower("h") is None  # another group's followers are not looked at
        two.wait(10)  # reaped by its parent, as rank 0 reaps its followers before it exits 70
        hit = watch.dead_follower("g")
        assert hit is not None and hit[0].rank == 2 and not hit[1].known, hit  # the pidfd still says dead
    finally:
        for p in (one, two, three):
            p.kill()
            p.wait(10)
        watch.close()


async def test_killing_a_group_kills_every_watched_follower_at_once_and_no_other_group() -> None:
    """Invariant 6: a group the agent kills has its followers SIGKILLed through their pidfds with rank 0, not after
    rank 0's teardown (PR_SET_PDEATHSIG)."""
    deaths: asyncio.Queue[Death] = asyncio.Queue()
    watch = RankWatch(lambda *d: deaths.put_nowait(d))
    one, two, other = _sleeper(), _sleeper(), _sleeper()
    try:
        watch.watch("g", [RankProcess(rank=1, pid=one.pid), RankProcess(rank=2, pid=two.pid)])
        watch.watch("h", [RankProcess(rank=1, pid=other.pid)])
        assert watch.kill("g") == 2
        assert [p.wait(10) for p in (one, two)] == [-signal.SIGKILL, -signal.SIGKILL]
        assert other.poll() is None  # another group's follower lives
        group, _, st, _ = await asyncio.wait_for(deaths.get(), 10)
        assert group == "g" and st is not None
        assert watch.kill("nobody") == 0
    finally:
        for p in (one, two, other):
            p.kill()
            p.wait()
        watch.close()
