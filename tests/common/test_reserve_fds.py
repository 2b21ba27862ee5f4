"""procs.reserve_fds sizes a process's descriptor table at start, so that a burst of accepts or passed fds later
never grows it (growing it waits for an RCU grace period in a threaded process: 13-45 ms on the H200 machine). Real
processes, their table read from /proc/<pid>/status (FDSize)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from libs.common import procs

CHILD = r"""
import json, os, socket, sys
from libs.common import procs

def table():  # the size of this process's descriptor table (FDSize in /proc/self/status)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("FDSize:"))

before = table()
asked = procs.reserve_fds(int(sys.argv[1]))
after = table()
socks = [socket.socket() for _ in range(int(sys.argv[2]))]  # many descriptors opened later
print(json.dumps({"before": before, "asked": asked, "after": after, "later": table(),
                  "open": len(os.listdir("/proc/self/fd"))}))
"""


def _child(count: int, opened: int, limit: int) -> dict:
    import resource

    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    out = subprocess.run([sys.executable, "-c", CHILD, str(count), str(opened)], capture_output=True, text=True,
                         check=True, preexec_fn=pre, cwd=os.getcwd(), timeout=60)
    return json.loads(out.stdout)


def test_the_table_is_sized_once_at_start_and_opening_many_later_does_not_grow_it() -> None:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    limit = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard)
    count = min(4096, limit)
    got = _child(count, min(600, count - 64), limit=limit)
    assert got["before"] < count <= got["after"], got
    assert got["later"] == got["after"], got  # 600 more descriptors fit in the table reserved


def test_the_soft_limit_caps_the_reservation_and_nothing_open_is_replaced() -> None:
    got = _child(4096, 10, limit=256)
    assert got["asked"] == 256 and got["after"] == 256, got
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = procs.FD_RESERVE if soft == resource.RLIM_INFINITY else min(procs.FD_RESERVE, soft)
    r, w = os.pipe()  # in this process: a descriptor open at the very number the reservation reaches stays as it is
    high = os.dup2(w, top - 1)
    try:
        assert procs.reserve_fds(procs.FD_RESERVE) == top
        os.write(high, b"x")
        assert os.read(r, 1) == b"x"
    finally:
        for fd in (r, w, high):
            os.close(fd)


def test_the_size_comes_from_the_environment_and_a_malformed_one_is_named(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("HF_FD_RESERVE", "0")
    assert procs.reserve_fds() == 0  # off
    monkeypatch.setenv("HF_FD_RESERVE", "many")
    with pytest.raises(ValueError, match="HF_FD_RESERVE must be a number of descriptors .*'many'"):
        procs.reserve_fds()
