"""`holdfast up` supervises its children: a SIGKILLed service or infra process is restarted (logged, with
backoff), the rest keep running, and SIGTERM still stops everything, the restarted ones included."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libs.common import procs

HOLDFAST = [sys.executable, "-m", "holdfast.main"]


def test_restart_delays_double_and_start_over_after_a_stable_run() -> None:
    from devstack.stack import ChildRestarts

    r = ChildRestarts(started_at=0.0)
    assert [r.died(1.0), r.died(2.0), r.died(3.0)] == [0.5, 1.0, 2.0]
    r.restarted(3.0)
    assert r.due_at is None and r.count == 1
    assert r.died(3.0 + 61.0) == 0.5  # it had run past STABLE_S: the shortest delay again


def _read_until(up: subprocess.Popen[str], pattern: str, lines: list[str], timeout: float) -> re.Match[str]:
    assert up.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"no line matching {pattern!r}:\n{''.join(lines)}")


@pytest.mark.slow
def test_up_restarts_a_killed_service_and_a_killed_etcd_then_stops_all(tmp_path: Path) -> None:
    ports = [procs.free_port() for _ in range(4)]
    argv = [*HOLDFAST, "up", "--nats-port", str(ports[0]), "--etcd-port", str(ports[1]), "--api-port", str(ports[2]),
            "--router-port", str(ports[3]), "--base-dir", str(tmp_path / "stack"), "--backend", "host"]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    lines: list[str] = []
    try:
        _read_until(up, "holdfast: ready", lines, 120)
        output = "".join(lines)
        pids = dict(re.findall(r"│\s*(\w+)\s*│\s*(\d+)\s*│", output))
        assert {"dc_manager", "etcd", "controller"} <= set(pids), output

        os.kill(int(pids["dc_manager"]), signal.SIGKILL)
        _read_until(up, r"dc_manager exited \(-9\); restarting in", lines, 10)
        new_dcm = int(_read_until(up, r"dc_manager restarted \(pid (\d+)", lines, 10).group(1))

        os.kill(int(pids["etcd"]), signal.SIGKILL)
        new_etcd = int(_read_until(up, r"etcd restarted \(pid (\d+)", lines, 20).group(1))
        time.sleep(8.0)  # past the controller's lease ttl: it rides out etcd's absence (no exit, no restart)
        assert procs.pid_alive(new_dcm) and procs.pid_alive(new_etcd)
        assert procs.pid_alive(int(pids["controller"])), "".join(lines)
        assert up.poll() is None
    finally:
        up.send_signal(signal.SIGTERM)
        rest, _ = up.communicate(timeout=60)
        lines.append(rest)
    assert up.returncode == 0, "".join(lines)
    time.sleep(0.5)
    every = [int(p) for p in pids.values()] + [new_dcm, new_etcd]
    left = [p for p in every if procs.pid_alive(p)]
    assert not left, f"still running: {left}"
