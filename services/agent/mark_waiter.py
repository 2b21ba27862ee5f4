"""The death-mark waiter: a process of the agent's own that waits on its engines' death marks (libs/common/death_mark.py)
and tells the agent, over a socket pair, the moment one wakes.

Why a process and not threads of the agent: a thread woken by a dying engine can hold the agent's GIL while it waits
for a CPU, and the agent's loop, its PF_EXITING poll included, then stalls behind it. Here the waits share no GIL
with the agent, which reads the waiter's socket on its loop like any other fd; the poll goes on beside it, and
whichever sees a death first reports it.

What it gains, and why it is off on 2 CPUs (the agent's `death_marks`, unset): on a 16-CPU H100 host a death was
published sooner at the median and at p99 (1.83 / 2.55 against 2.80 / 3.83 ms for the poll alone; docs/benchmarks.md
"Failure detection"). On the 2-core test machine it was sooner at the median (2.6-2.9 against 3.6-3.9 ms) but later
at p99: a tight poll of /proc saw PF_EXITING 0.1-0.2 ms after each SIGKILL while the waiter woke up to 4 ms later in
~1 kill in 10: it is woken on the CPU where the dying process tears its memory down and waits there for the next
tick, and its report then pulls the agent's loop onto that CPU too (the poll, woken by its own timer, is not). With
idle cores that wait did not arise.

Frames (libs/common/wire.py), agent -> waiter: `arm {key, seq, pid}` with the mark's fd; `disarm {key, seq}`.
Waiter -> agent: `armed {key, seq}` (waiting on it now), `woke {key, seq, word}` (the mark's word changed: its
owner died, or it was released or overwritten), or `woke {key, seq, error}` (refused, or the wait failed: the agent polls that engine). The waiter
exits when the agent's end closes (the agent's exit closes it, however it dies); it ignores SIGINT and SIGTERM.

`python -m services.agent.mark_waiter FD`: FD is the waiter's end of the pair.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from libs.common import wire
from libs.common.death_mark import MarkView
from libs.common.errors import HoldfastError, MalformedMessage

log = logging.getLogger("holdfast.agent.marks")
MARK_WAIT_S = 1.0  # a wait looks at its stop flag at least this often


# ------------------------------------------------------------ the waiter process


class _Wait:
    """One mark waited on by a thread; `stop` ends it at once (it wakes the wait). It unmaps the mark as it ends."""

    def __init__(self, view: MarkView, key: str, seq: int, tell: Callable[[dict[str, Any]], None]) -> None:
        self.view, self.key, self.seq, self._tell = view, key, seq, tell
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # the view is woken only while mapped
        threading.Thread(target=self._run, name=f"mark:{key}", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            if not self.view.closed:
                self.view.wake()

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                word = self.view.wait(MARK_WAIT_S)
                if word != self.view.armed_with:
                    if not self._stopped.is_set():
                        self._tell({"op": "woke", "key": self.key, "seq": self.seq, "word": word})
                    return
        except OSError as e:
            self._tell({"op": "woke", "key": self.key, "seq": self.seq, "error": f"the wait failed: {e}"})
        finally:
            with self._lock:
                self.view.close()


def serve(sock: socket.socket) -> None:
    """Arm and disarm as the agent says until its end closes."""
    send_lock = threading.Lock()

    def tell(msg: dict[str, Any]) -> None:
        with send_lock:
            try:
                wire.send_frame(sock, msg)
            except OSError:
                pass  # the agent is gone: the main loop ends on its own

    waits: dict[str, _Wait] = {}
    while True:
        try:
            msg, fds = wire.recv_frame(sock)
        except (ConnectionError, OSError, HoldfastError):
            return
        key, seq = str(msg.get("key")), int(msg.get("seq") or 0)
        old = waits.pop(key, None)
        if old is not None:
            old.stop()
        if msg.get("op") != "arm":
            wire.close_fds(fds)
            continue
        try:
            if len(fds) != 1:
                raise MalformedMessage(f"arm carries one fd, not {len(fds)}")
            waits[key] = _Wait(MarkView(fds[0], int(msg.get("pid") or 0)), key, seq, tell)
            tell({"op": "armed", "key": key, "seq": seq})
        except MalformedMessage as e:
            tell({"op": "woke", "key": key, "seq": seq, "error": str(e)})
        finally:
            wire.close_fds(fds)


def main(argv: list[str]) -> int:
    # Its life is the agent's socket, not the signals its process group gets: a terminal's Ctrl-C or a supervisor's
    # SIGTERM to the group would end it before the agent, which then warned of a lost waiter while it stopped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    serve(socket.socket(fileno=int(argv[0])))
    return 0


# ------------------------------------------------------------ the agent's end


class MarkWaiter:
    """The agent's end: the waiter started at the first `arm` (and again after it died), its reports read on the loop
    and handed to `on_woke(key, word, error)` (`word` None with an `error`), each for a mark armed then (a report
    of an arm since replaced or disarmed is dropped). Runs on the event loop's thread."""

    def __init__(self, on_woke: Callable[[str, int | None, str | None], None]) -> None:
        self._on_woke = on_woke
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._armed: dict[str, int] = {}  # key -> seq of its arm, while the waiter has it
        self._waiting: set[str] = set()  # the keys the waiter said it waits on
        self._arms = 0  # the last arm's seq

    def arm(self, key: str, pid: int, fd: int) -> None:
        """Hand the mark `fd` of process `pid` to the waiter in place of `key`'s mark, if it had one (`fd` stays the
        caller's). Checked here first, so that a mark that is not one is refused at once (`MalformedMessage`), as
        the waiter would."""
        self.disarm(key)
        MarkView(fd, pid).close()
        sock = self.start()
        self._arms += 1
        try:
            wire.send_frame(sock, {"op": "arm", "key": key, "seq": self._arms, "pid": pid}, [fd])
        except OSError as e:
            self._lost(f"the waiter could not be told: {e}")
            raise MalformedMessage(f"the death-mark waiter is unreachable: {e}") from None
        self._armed[key] = self._arms

    def armed(self, key: str) -> bool:
        """Whether `key`'s mark is armed (handed to the waiter, and neither reported nor disarmed since)."""
        return key in self._armed

    @property
    def pid(self) -> int | None:
        """The waiter process's pid while it runs."""
        return self._proc.pid if self._proc is not None else None

    def waiting(self, key: str) -> bool:
        """Whether the waiter said it waits on `key`'s mark (a death before that is the poll's)."""
        return key in self._waiting

    def disarm(self, key: str) -> None:
        self._waiting.discard(key)
        seq = self._armed.pop(key, None)
        if seq is not None and self._sock is not None:
            try:
                wire.send_frame(self._sock, {"op": "disarm", "key": key, "seq": seq})
            except OSError as e:
                self._lost(f"the waiter could not be told: {e}")

    def close(self) -> None:
        """Close our end: the waiter exits (waited for briefly, then killed)."""
        sock, proc = self._sock, self._proc
        self._sock, self._proc = None, None
        self._armed.clear()
        self._waiting.clear()
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        if proc is not None:
            try:
                proc.wait(1.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)

    def start(self) -> socket.socket:
        """The waiter, started if it is not running; our end of its socket."""
        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # only what an interpreter needs to find our modules: none of the agent's credentials or settings
            env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LANG", "LC_ALL")}
            self._proc = subprocess.Popen([sys.executable, "-m", "services.agent.mark_waiter", str(theirs.fileno())],
                                          pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.settimeout(1.0)  # a send never blocks the loop for longer (frames are tens of bytes)
        asyncio.get_running_loop().add_reader(ours.fileno(), self._readable)
        self._sock = ours
        log.info("death-mark waiter started (pid %d)", self._proc.pid)
        return ours

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            msg, fds = wire.recv_frame(sock)
        except (ConnectionError, OSError, HoldfastError) as e:
            self._lost(f"its socket ended ({e})")
            return
        wire.close_fds(fds)
        key, seq = str(msg.get("key")), int(msg.get("seq") or 0)
        if self._armed.get(key) != seq:
            return  # disarmed, or armed again since
        if msg.get("op") == "armed":
            self._waiting.add(key)
            return
        del self._armed[key]
        self._waiting.discard(key)
        word = msg.get("word")
        self._on_woke(key, int(word) if isinstance(word, int) else None,
                      None if isinstance(word, int) else str(msg.get("error") or "no word"))

    def _lost(self, why: str) -> None:
        """The waiter died or cannot be spoken to: every mark it held is reported lost (their engines are polled); the
        next `arm` starts another."""
        log.warning("death-mark waiter lost: %s; %d engines' exits are polled", why, len(self._armed))
        armed, self._armed = self._armed, {}
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self.close()
        for key in armed:
            self._on_woke(key, None, f"the waiter was lost: {why}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
