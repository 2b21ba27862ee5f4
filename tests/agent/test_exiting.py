"""A death seen coming: /proc's PF_EXITING and exit status, before the pidfd reports the end of the teardown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from libs.common.errors import MalformedMessage
from services.agent.pidfd import (
    ExitStatus,
    PidWatcher,
    decode_wait_status,
    proc_exiting,
    proc_state,
)
from tests.common.mark_owner import owner
from tests.support import wait_until


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def _poll_until_reported(w: PidWatcher) -> list[tuple[str, ExitStatus]]:
    """Blocking polls: the loop does not run meanwhile, so the pidfd's callback cannot take the key first."""
    for _ in range(3000):
        got = w.poll_exiting()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError("never seen exiting")


async def _armed(w: PidWatcher, key: str, pid: int, fd: int) -> None:
    """`pid` watched under `key` and armed with its mark `fd`, once the waiter process (started with the first
    mark) waits on it."""
    w.watch(key, pid, child=True)
    w.arm(key, fd)
    assert w.armed(key)
    await wait_until(lambda: w.mark_waited(key), within_s=30, every=0.01, what="the mark waited on")


async def test_a_killed_process_is_seen_exiting_with_its_signal_exactly_once() -> None:
    exits: list[str] = []
    w = PidWatcher(lambda key, st: exits.append(key))
    p = _child("import time; time.sleep(60)")
    try:
        w.watch("e1", p.pid, child=False)
        assert w.poll_exiting() == []  # alive: nothing
        os.kill(p.pid, signal.SIGKILL)
        (key, st), = _poll_until_reported(w)
        assert key == "e1" and st.known and st.signal == signal.SIGKILL and st.exit_code is None
        assert w.poll_exiting() == []  # reported once
    finally:
        p.wait(10)
        w.close()


async def test_an_exit_code_is_read_before_the_process_is_reaped() -> None:
    w = PidWatcher(lambda key, st: None)
    p = _child("import sys, time; time.sleep(0.2); sys.exit(3)")
    try:
        w.watch("e2", p.pid, child=False)
        # Blocking waits (the loop does not run, so the pidfd's callback cannot take the key first).
        deadline = time.monotonic() + 30
        while proc_state(p.pid) != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (_, st), = w.poll_exiting()
        assert st.exit_code == 3 and st.signal is None
    finally:
        p.wait(10)
        w.close()


def test_wait_statuses_decode_into_exit_codes_and_signals() -> None:
    assert decode_wait_status(3 << 8) == (3, None)
    assert decode_wait_status(signal.SIGSEGV | 0x80) == (None, signal.SIGSEGV)  # with a core dump
    assert decode_wait_status(signal.SIGKILL) == (None, signal.SIGKILL)


async def test_watching_keeps_one_stat_file_per_process_and_closes_it_when_unwatched() -> None:
    children = [_child("import time; time.sleep(60)") for _ in range(5)]
    w = PidWatcher(lambda key, st: None)
    before = len(os.listdir("/proc/self/fd"))
    try:
        for i, c in enumerate(children):
            w.watch(f"e{i}", c.pid, child=True)
        assert len(os.listdir("/proc/self/fd")) == before + 2 * len(children)  # a pidfd and a stat file each
        assert w.poll_exiting() == []  # all alive
        for i in range(len(children)):
            w.unwatch(f"e{i}")
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        w.close()
        for c in children:
            c.kill()
            c.wait()


async def test_a_recycled_pid_is_refused_by_its_start_time() -> None:
    c = _child("import time; time.sleep(60)")
    w = PidWatcher(lambda key, st: None)
    before = len(os.listdir("/proc/self/fd"))
    try:
        from services.agent.pidfd import proc_start_time

        start = proc_start_time(c.pid)
        assert start is not None
        try:
            w.watch("e", c.pid, child=True, start_time=start + 1)
        except ProcessLookupError:
            pass
        else:
            raise AssertionError("a wrong start time was accepted")
        assert len(os.listdir("/proc/self/fd")) == before and not w.watching("e")
    finally:
        w.close()
        c.kill()
        c.wait()


async def test_an_armed_process_is_reported_by_its_death_mark_without_a_poll() -> None:
    """Nothing polls here: the death is seen through the mark, as it begins (the owner's 256 MiB keep its pidfd
    from saying dead for tens of ms more), with the signal the kernel recorded."""
    loop = asyncio.get_running_loop()
    seen: asyncio.Future[ExitStatus] = loop.create_future()
    exits: list[str] = []
    w = PidWatcher(lambda key, st: exits.append(key), on_exiting=lambda key, st: seen.set_result(st))
    with owner() as (p, _sock, fd):
        try:
            await _armed(w, "e", p.pid, fd)
            os.kill(p.pid, signal.SIGKILL)
            st = await asyncio.wait_for(seen, 30)
            assert st.seen == "death mark" and st.signal == signal.SIGKILL and st.known
            assert not w.armed("e") and w.poll_exiting() == []  # reported once
        finally:
            w.close()


async def test_an_armed_process_is_polled_too_and_its_death_reported_once_by_whichever_saw_it_first() -> None:
    reported: list[ExitStatus] = []
    w = PidWatcher(lambda key, st: None, on_exiting=lambda key, st: reported.append(st))
    with owner() as (p, _sock, fd):
        try:
            w.watch("e", p.pid, child=True)
            w.arm("e", fd)
            os.kill(p.pid, signal.SIGKILL)
            # Blocking from here: the loop does not run, so neither the mark's report nor the pidfd's comes first.
            deadline = time.monotonic() + 30
            while proc_exiting(p.pid) is None:
                assert time.monotonic() < deadline
                time.sleep(0.001)
            (key, st), = w.poll_exiting()
            assert key == "e" and st.seen == "poll" and st.signal == signal.SIGKILL
            # the loop runs the mark's report now (or the pidfd's): reported already, once
            await wait_until(lambda: not w.armed("e"), within_s=30, every=0.01, what="the mark's report")
            assert reported == []
        finally:
            w.close()
    w = PidWatcher(lambda key, st: None)
    with owner() as (p, _sock, fd):
        try:
            w.watch("e", p.pid, child=True)
            w.arm("e", fd)
            w.disarm("e")
            os.kill(p.pid, signal.SIGKILL)
            (_, st), = _poll_until_reported(w)
            assert st.seen == "poll" and st.signal == signal.SIGKILL
        finally:
            w.close()


async def test_a_mark_that_is_not_the_processes_is_refused_and_closed() -> None:
    w = PidWatcher(lambda key, st: None)
    c = _child("import time; time.sleep(60)")
    with owner() as (p, _sock, fd):
        try:
            w.watch("e", c.pid, child=True)  # the mark names p, not c
            before = len(os.listdir("/proc/self/fd"))
            with pytest.raises(MalformedMessage):
                w.arm("e", fd)
            assert not w.armed("e") and len(os.listdir("/proc/self/fd")) == before - 1  # its fd closed
        finally:
            w.close()
            c.kill()
            c.wait()


async def test_a_lost_mark_waiter_leaves_its_engines_to_the_poll_and_the_next_mark_starts_another() -> None:
    w = PidWatcher(lambda key, st: None, on_exiting=lambda key, st: None)

    async def until(cond: Callable[[], bool]) -> None:
        await wait_until(cond, within_s=30, every=0.01)

    with owner() as (p, _sock, fd), owner() as (q, _sock2, fd2):
        try:
            w.watch("p", p.pid, child=True)
            w.watch("q", q.pid, child=True)
            w.arm("p", fd)
            await until(lambda: w.mark_waited("p"))
            waiter = w.mark_waiter
            assert waiter.pid is not None
            first = waiter.pid
            with open(f"/proc/{first}/environ", "rb") as f:  # none of the agent's settings or credentials
                assert not [v for v in f.read().split(b"\0") if v.startswith(b"HF_")]
            os.kill(first, signal.SIGKILL)
            await until(lambda: not w.armed("p"))  # lost: p's exit is the poll's now
            assert w.poll_exiting() == []  # and p lives on, unharmed
            w.arm("q", fd2)  # another waiter for the next mark
            await until(lambda: w.mark_waited("q"))
            assert waiter.pid is not None and waiter.pid != first
            os.kill(q.pid, signal.SIGKILL)
            await until(lambda: not w.armed("q"))
            os.kill(p.pid, signal.SIGKILL)
            (key, st), = _poll_until_reported(w)
            assert key == "p" and st.seen == "poll"
        finally:
            w.close()


@pytest.mark.parametrize(("setting", "cpus", "on"), [(None, {0, 1}, False), (None, {0}, False),
                                                     (None, {0, 1, 2}, True), (True, {0}, True), (False, set(range(16)), False)])
def test_death_marks_unset_follow_the_cpus_the_agent_may_run_on(monkeypatch: pytest.MonkeyPatch, setting: bool | None,
                                                                  cpus: set[int], on: bool) -> None:
    """Unset, the marks are waited on where the agent may run on more than 2 CPUs (measured: sooner at p50 and p99 on
    16, later at p99 on 2); set, the setting holds."""
    from services.agent.settings import AgentSettings

    monkeypatch.delenv("HF_DEATH_MARKS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)
    assert AgentSettings(death_marks=setting).marks_on() is on


async def test_the_mark_waiter_outlives_its_groups_sigterm_and_sigint_and_ends_with_the_agents_end() -> None:
    """A terminal's Ctrl-C or a supervisor's SIGTERM reaches the agent's whole process group: the waiter keeps
    waiting (the agent may still be stopping) and ends when the agent's end of its socket closes."""
    seen: list[ExitStatus] = []
    w = PidWatcher(lambda key, st: None, on_exiting=lambda key, st: seen.append(st))
    with owner() as (p, _sock, fd):
        try:
            await _armed(w, "e", p.pid, fd)
            waiter = w.mark_waiter.pid
            assert waiter is not None
            for sig in (signal.SIGTERM, signal.SIGINT):
                os.kill(waiter, sig)
            await asyncio.sleep(0.2)
            assert proc_state(waiter) not in (None, "Z") and w.mark_waited("e")
            os.kill(p.pid, signal.SIGKILL)
            await wait_until(lambda: seen, within_s=30, every=0.01, what="the death seen")
            assert seen[0].seen == "death mark"
        finally:
            w.close()
    await wait_until(lambda: proc_state(waiter) in (None, "Z"), within_s=10, every=0.01, what="the waiter's end")
