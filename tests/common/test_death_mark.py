"""Death marks (libs/common/death_mark.py) between real processes: a mark's owner SIGKILLed wakes its watcher with the
death already in /proc; a mark released without a death wakes it without one; what is not a mark is refused."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import threading

import pytest

from libs.common.death_mark import FUTEX_WAITERS, SIZE, DeathMark, MarkView, Unsupported, died
from libs.common.errors import MalformedMessage
from services.agent.pidfd import proc_exiting
from tests.common.mark_owner import owner


def wait_in_thread(view: MarkView) -> tuple[threading.Thread, list[int]]:
    got: list[int] = []

    def run() -> None:
        while True:
            word = view.wait(1.0)
            if word != view.armed_with:
                got.append(word)
                return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def test_a_killed_owner_wakes_its_watcher_with_its_death_already_in_proc() -> None:
    with owner() as (p, _sock, fd):
        view = MarkView(fd, p.pid)
        os.close(fd)
        assert view.armed_with == p.pid | FUTEX_WAITERS
        t, got = wait_in_thread(view)
        os.kill(p.pid, signal.SIGKILL)
        t.join(30)
        assert got and died(got[0])
        # the kernel releases the mark after it set PF_EXITING and the exit status: both readable at the wake
        assert proc_exiting(p.pid) == signal.SIGKILL
        view.close()


def test_a_mark_released_without_a_death_wakes_its_watcher_without_one() -> None:
    with owner() as (p, sock, fd):
        view = MarkView(fd, p.pid)
        os.close(fd)
        t, got = wait_in_thread(view)
        sock.send(b"u")
        assert sock.recv(1) == b"k"
        t.join(30)
        assert got and not died(got[0])
        assert p.poll() is None and proc_exiting(p.pid) is None  # alive: the word alone never says dead
        view.close()


def test_a_wake_ends_a_wait_and_a_wait_ends_at_its_timeout() -> None:
    with owner() as (p, _sock, fd):
        view = MarkView(fd, p.pid)
        os.close(fd)
        assert view.wait(0.01) == view.armed_with  # timed out: the owner lives
        done = threading.Event()
        t = threading.Thread(target=lambda: (view.wait(30), done.set()), daemon=True)
        t.start()
        while t.is_alive() and not done.is_set():
            view.wake()
            done.wait(0.01)
        assert done.is_set()
        view.close()
        assert view.closed


def _memfd(word: int, *, seal: bool = True) -> int:
    fd = os.memfd_create("not-a-mark", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    os.pwrite(fd, word.to_bytes(4, "little"), 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


@pytest.mark.parametrize("case", ["unsealed", "other_owner", "no_waiters", "short", "regular_file", "socket"])
def test_what_is_not_the_engines_mark_is_refused(case: str, tmp_path) -> None:  # noqa: ANN001 - pytest's
    pid = os.getpid()
    if case == "unsealed":
        fd = _memfd(pid | FUTEX_WAITERS, seal=False)
    elif case == "other_owner":
        fd = _memfd((pid + 1) | FUTEX_WAITERS)
    elif case == "no_waiters":
        fd = _memfd(pid)
    elif case == "short":
        fd = os.memfd_create("short", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    elif case == "regular_file":
        path = tmp_path / "mark"
        path.write_bytes((pid | FUTEX_WAITERS).to_bytes(4, "little") + bytes(SIZE - 4))
        fd = os.open(path, os.O_RDONLY)
    else:
        a, b = socket.socketpair()
        fd = a.detach()
        b.close()
    try:
        with pytest.raises(MalformedMessage):
            MarkView(fd, pid)
    finally:
        os.close(fd)


def test_a_mark_is_made_on_the_main_thread_only() -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            DeathMark.create()
        except BaseException as e:  # noqa: BLE001 - what it raised is the test's subject
            errors.append(e)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], Unsupported)
