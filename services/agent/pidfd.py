"""Process death noticed through pidfds on the event loop: no SIGCHLD races; and seen coming through
/proc: a process that has begun to exit.

`os.pidfd_open(pid)` gives an fd that becomes readable when the process exits; the loop's reader
callback fires within microseconds of the death. But "exits" is the end of the kernel's teardown: for a
process with a CUDA context the driver's cleanup takes ~100-150 ms between the fatal signal and that moment
(docs/benchmarks.md, H200 probe). The kernel marks the task PF_EXITING and records its exit status at the
very start of the teardown (do_exit); both are in /proc/<pid>/stat (fields 9 and 52), so `poll_exiting`
sees the death coming within one poll period. The process can no longer run user code then, but it still
holds its memory: what must wait for the death itself (kill-before-transfer) still waits for the pidfd. For our own children `os.waitid(P_PIDFD, ...)` reaps
them and yields the exit code or signal; a process adopted from someone else cannot be waited on, so its
status is the one its zombie still shows in /proc (`zombie_status`), else unknown (the caller decides what that
means). Signals go through `pidfd_send_signal`, which
cannot hit a recycled pid.

With the agent's death marks on (`death_marks`; unset, above 2 CPUs), an engine that sent a death mark (libs/common/death_mark.py: a robust futex the
kernel releases right after it sets PF_EXITING) is *armed*: the agent's mark waiter (mark_waiter.py, a process of its
own) waits on the mark and tells the loop the moment it wakes, which then looks at /proc, so the death is usually
seen as it begins rather than up to a poll period later. The poll still looks at an armed engine every pass, and
whichever sees the death first reports it (once). A mark that wakes without the death, or is refused, leaves the
engine to the poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from libs.common.death_mark import died
from libs.common.events import FaultKind
from libs.common.procs import PF_EXITING, stat_fields
from services.agent.mark_waiter import MarkWaiter

log = logging.getLogger("holdfast.agent.pidfd")


@dataclass(frozen=True)
class ExitStatus:
    pid: int
    at: float  # epoch seconds when the loop noticed the death
    known: bool  # False: not our child, the exit code/signal is unknowable
    exit_code: int | None = None
    signal: int | None = None
    seen: str = ""  # a death seen beginning: how ("poll": PF_EXITING polled; "death mark": its mark woke)


def known_fault(st: ExitStatus) -> tuple[FaultKind, str]:
    """The fault of a death whose signal or exit code the kernel gave (`st.known`): its kind and what killed it
    ("signal SIGKILL", "exit code 1"; a signal with no name, a real-time one, by its number)."""
    if st.signal is not None:
        try:
            name = signal.Signals(st.signal).name
        except ValueError:
            name = str(st.signal)
        return FaultKind.KILLED, f"signal {name}"
    return FaultKind.EXITED, f"exit code {st.exit_code}"


def open_stat(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    return None


def proc_start_time(pid: int, stat_fd: int | None = None) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None if gone.

    A pid together with its start time names one process forever: a recycled pid has another start time.
    """
    rest = stat_fields(pid, stat_fd=stat_fd)
    return None if rest is None else int(rest[19])  # field 22 overall


def proc_state(pid: int) -> str | None:
    """The one-letter state of /proc/<pid>/stat (R, S, T for stopped, Z for zombie...)."""
    rest = stat_fields(pid)
    return None if rest is None else rest[0].decode()




def proc_exiting(pid: int, stat_fd: int | None = None) -> int | None:
    """The exit status (wait-status encoding) of a process that has begun to exit; None if it has not (or is
    gone). 0 can mean "not recorded yet" for a moment after PF_EXITING is set: the caller looks again."""
    rest = stat_fields(pid, stat_fd=stat_fd)
    if rest is None or not int(rest[6]) & PF_EXITING:  # field 9: flags
        return None
    return int(rest[49]) if len(rest) > 49 else 0  # field 52: exit_code (Linux >= 3.5)


def decode_wait_status(code: int) -> tuple[int | None, int | None]:
    """(exit_code, signal) from a wait-status word."""
    if code & 0x7F:
        return None, code & 0x7F
    return (code >> 8) & 0xFF, None


class PidWatcher:
    """Watch processes by key (engine id); `on_exit(key, status)` runs on the loop when one dies."""

    def __init__(self, on_exit: Callable[[str, ExitStatus], None], *, zombie_status: bool = False,
                 on_exiting: Callable[[str, ExitStatus], None] | None = None) -> None:
        """`zombie_status`: a process that is not our child gets the status its zombie still holds in /proc when the
        pidfd says dead (its parent has not reaped it yet; otherwise unknown, as ever). `on_exiting(key, status)`:
        an armed process seen exiting when its mark woke (what `poll_exiting` returns for the others)."""
        self._on_exit = on_exit
        self._on_exiting = on_exiting
        self._marks = MarkWaiter(self._marked)  # its process starts with the first mark (or `start_marks`)
        self._zombie_status = zombie_status
        self._fds: dict[str, tuple[int, int, bool]] = {}  # key -> (pidfd, pid, child)
        self._waiters: dict[str, list[asyncio.Future[ExitStatus]]] = {}
        self._dead: dict[str, ExitStatus] = {}
        self._exiting: dict[str, int] = {}  # key -> polls that saw it exiting (reported once, at most)
        self._stat: dict[str, int] = {}  # key -> its /proc/<pid>/stat, kept open for the exit poll

    def watch(self, key: str, pid: int, *, child: bool, start_time: int | None = None) -> None:
        """Start watching; raises ProcessLookupError if the process (with that start time) is gone."""
        self.unwatch(key)
        fd = os.pidfd_open(pid)
        stat_fd = open_stat(pid)
        # Both fds name the process that had this pid when they were opened: if its start time still
        # matches now, that is the process we meant.
        if start_time is not None and proc_start_time(pid, stat_fd) != start_time:
            os.close(fd)
            if stat_fd is not None:
                os.close(stat_fd)
            raise ProcessLookupError(f"pid {pid} was recycled")
        self._fds[key] = (fd, pid, child)
        if stat_fd is not None:
            self._stat[key] = stat_fd
        self._dead.pop(key, None)
        asyncio.get_running_loop().add_reader(fd, self._readable, key)

    def poll_exiting(self) -> list[tuple[str, ExitStatus]]:
        """Watched processes seen exiting since the last poll, each once, with the status the kernel holds (an armed
        one too, unless its mark told first)."""
        out = []
        for key in list(self._fds):
            st = self._look(key, "poll")
            if st is not None:
                out.append((key, st))
        return out

    def _look(self, key: str, seen: str) -> ExitStatus | None:
        """`key` seen exiting now, once: the status the kernel holds. A status of 0 is trusted only on a second look
        (the kernel sets the flag a moment before the code)."""
        entry = self._fds.get(key)
        looks = self._exiting.get(key, 0)
        if entry is None or looks < 0:
            return None  # not watched, or reported already
        pid = entry[1]
        code = proc_exiting(pid, self._stat.get(key))
        if code is None:
            return None
        if code == 0 and looks == 0:
            self._exiting[key] = 1
            return None
        self._exiting[key] = -1
        exit_code, sig = decode_wait_status(code)
        return ExitStatus(pid=pid, at=time.time(), known=True, exit_code=exit_code, signal=sig, seen=seen)

    def start_marks(self) -> None:
        """Start the mark waiter now rather than with the first mark (it takes ~0.1 s to start: a death in that
        time is the poll's)."""
        self._marks.start()

    def arm(self, key: str, fd: int) -> None:
        """Have the mark waiter wait on the death mark `fd` of the watched process `key` (closed here, whatever
        happens). Raises `MalformedMessage` for a mark that is not its (libs/common/death_mark.py rule 2) and
        KeyError when `key` is not watched; the poll goes on for it then, as it does anyway."""
        try:
            self._marks.arm(key, self._fds[key][1], fd)
        finally:
            os.close(fd)

    def armed(self, key: str) -> bool:
        return self._marks.armed(key)

    @property
    def mark_waiter(self) -> MarkWaiter:
        return self._marks

    def mark_waited(self, key: str) -> bool:
        """Whether the mark waiter waits on `key`'s mark now (an armed mark until it says so: a moment)."""
        return self._marks.waiting(key)

    def disarm(self, key: str) -> None:
        self._marks.disarm(key)

    def _marked(self, key: str, word: int | None, error: str | None) -> None:
        """On the loop: `key`'s armed mark woke with `word` (or was lost: `error`). A death begun is reported now."""
        if word is None or not died(word):
            log.warning("engine %s's death mark woke without its death (%s): its exit is polled", key,
                        error if word is None else f"{word:#x}")
            return
        st = self._look(key, "death mark")
        if st is not None and self._on_exiting is not None:
            self._on_exiting(key, st)

    def watching(self, key: str) -> bool:
        return key in self._fds

    def dead_now(self, key: str) -> ExitStatus | None:
        """A watched process's death if it has already begun (PF_EXITING) or ended (its pidfd readable), looked at
        now rather than when the loop comes to its reader or next poll; None while it lives or is not watched. The
        status is the kernel's where /proc still holds it (a zombie's, or an exiting process's), else unknown."""
        entry = self._fds.get(key)
        if entry is None:
            return None
        fd, pid, _child = entry
        code = proc_exiting(pid, self._stat.get(key))
        if code:
            exit_code, sig = decode_wait_status(code)
            return ExitStatus(pid=pid, at=time.time(), known=True, exit_code=exit_code, signal=sig)
        if not select.select([fd], [], [], 0)[0]:
            return None
        return ExitStatus(pid=pid, at=time.time(), known=False)

    def unwatch(self, key: str) -> None:
        self.disarm(key)
        entry = self._fds.pop(key, None)
        self._exiting.pop(key, None)
        stat_fd = self._stat.pop(key, None)
        if stat_fd is not None:
            os.close(stat_fd)
        if entry is not None:
            asyncio.get_running_loop().remove_reader(entry[0])
            os.close(entry[0])

    def close(self) -> None:
        for key in list(self._fds):
            self.unwatch(key)
        self._marks.close()

    def signal(self, key: str, sig: int = signal.SIGKILL) -> bool:
        """Send `sig` through the pidfd; False when the process is already gone or not watched."""
        entry = self._fds.get(key)
        if entry is None:
            return False
        try:
            signal.pidfd_send_signal(entry[0], sig)
        except ProcessLookupError:
            return False
        return True

    async def wait_dead(self, key: str, within_s: float | None = None) -> ExitStatus:
        """The death of a watched process (immediately if it already died)."""
        if key in self._dead:
            return self._dead[key]
        if key not in self._fds:
            raise KeyError(key)
        fut: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        return await asyncio.wait_for(asyncio.shield(fut), within_s)

    def _readable(self, key: str) -> None:
        at = time.time()
        entry = self._fds.pop(key, None)
        self._exiting.pop(key, None)
        self.disarm(key)
        if entry is None:
            return
        fd, pid, child = entry
        stat_fd = self._stat.pop(key, None)  # of no use after the death: closed below
        asyncio.get_running_loop().remove_reader(fd)
        status = ExitStatus(pid=pid, at=at, known=False)
        if not child and self._zombie_status and stat_fd is not None:
            code = proc_exiting(pid, stat_fd)  # a zombie's exit code is final (None: reaped, the file reads nothing)
            if code is not None:
                exit_code, sig = decode_wait_status(code)
                status = ExitStatus(pid=pid, at=at, known=True, exit_code=exit_code, signal=sig)
        if stat_fd is not None:
            os.close(stat_fd)
        if child:
            try:
                res = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                res = None  # reaped elsewhere (should not happen): report an unknown status
            if res is not None:
                if res.si_code == os.CLD_EXITED:
                    status = ExitStatus(pid=pid, at=at, known=True, exit_code=res.si_status)
                else:  # CLD_KILLED or CLD_DUMPED
                    status = ExitStatus(pid=pid, at=at, known=True, signal=res.si_status)
        os.close(fd)
        self._dead[key] = status
        for fut in self._waiters.pop(key, []):
            if not fut.done():
                fut.set_result(status)
        try:
            self._on_exit(key, status)
        except Exception:  # noqa: BLE001 - a failing callback must not break the loop's reader dispatch
            log.exception("exit callback for %s failed", key)

    def forget(self, key: str) -> None:
        self._dead.pop(key, None)


def signal_pid(pid: int, sig: int, start_time: int | None) -> bool:
    """Signal a process we do not watch, only if it is still the one that started at `start_time`."""
    with contextlib.suppress(ProcessLookupError):
        fd = os.pidfd_open(pid)
        try:
            if start_time is not None and proc_start_time(pid) != start_time:
                return False
            signal.pidfd_send_signal(fd, sig)
            return True
        finally:
            os.close(fd)
    return False


async def end_process(fd: int, term_wait_s: float) -> bool:
    """SIGTERM the process behind pidfd `fd` (our child or not), SIGKILL it if it has not exited `term_wait_s` later;
    closes `fd`. True once it exited (the pidfd turned readable), False if it outlived the SIGKILL's wait too or may
    not be signalled by us (another uid's, `allowed_uids`)."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(fd, readable)
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                signal.pidfd_send_signal(fd, sig)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            try:
                async with asyncio.timeout(term_wait_s):
                    await asyncio.shield(gone)
                return True
            except TimeoutError:
                continue
        return False
    finally:
        loop.remove_reader(fd)
        os.close(fd)
