"""A process that speaks to the agent's socket as an engine would, or as a buggy or hostile one: for the link tests.

`FakeLink` runs `SCRIPT` in a process of its own (the agent checks a registration's pid against SO_PEERCRED's and
watches that process): it sends the `register` it is given, then each step, and prints every reply as a JSON line
(`{"exc": ...}` where none came); then "done", and it sleeps until killed. A step is a message, or raw bytes to send
(`{"raw": hex, "fds": n}`: n dups of /dev/null ride on them) after which it waits for a reply all the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from libs.common import wire
from tests.agent.conftest import ROOT

SCRIPT = """
import array, json, os, socket, sys, time
from libs.common import wire
path, register, steps = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
null = os.open("/dev/null", os.O_RDONLY)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(path)
def answer():
    try:
        print(json.dumps(wire.recv_frame(s)[0]), flush=True)
    except Exception as e:
        print(json.dumps({"exc": repr(e)}), flush=True)
wire.send_frame(s, {"op": "register", "pid": os.getpid(), **register})
answer()
for step in steps:
    try:
        if "raw" in step:
            fds = array.array("i", [null] * step["fds"]).tobytes()
            s.sendmsg([bytes.fromhex(step["raw"])], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if step["fds"] else [])
        else:
            wire.send_frame(s, step)
    except OSError as e:
        print(json.dumps({"exc": repr(e)}), flush=True)
        continue
    answer()
print("done", flush=True)
time.sleep(120)
"""


class FakeLink:
    def __init__(self, socket_path: str, register: dict[str, Any], steps: Sequence[dict[str, Any]] = ()) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SCRIPT, socket_path, json.dumps(register),
                                      json.dumps(list(steps))],
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def replies(self) -> list[Any]:
        """Every reply, the registration's first, once the steps are done."""
        out: list[Any] = []
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 30)
            if line.strip() in (b"done", b""):
                return out
            out.append(json.loads(line))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def raw_frame(obj: dict[str, Any], nfds: int = 0, *, cut: int = 0) -> str:
    """A frame's bytes as `FakeLink` steps take them (hex), declaring `nfds` fds, less its last `cut` bytes."""
    data = b"".join(seg for seg, _ in wire.encode_frame(obj, [0] * nfds))
    return (data[:-cut] if cut else data).hex()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def null_fds(pid: int) -> int:
    """How many of process `pid`'s fds are /dev/null (what the fakes send as fds)."""
    fd_dir = f"/proc/{pid}/fd"
    return sum(_link(f"{fd_dir}/{n}") == "/dev/null" for n in os.listdir(fd_dir))


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile
        return ""
