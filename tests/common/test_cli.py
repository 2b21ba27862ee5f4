"""The command line: every sub-command is listed, and `holdfast up` starts and stops everything cleanly."""

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


def test_help_lists_every_sub_command() -> None:
    out = subprocess.run([*HOLDFAST, "--help"], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    for cmd in ("up", "demo", "status", "bench", "gpu-manager", "agent", "dc-manager", "controller", "router", "engine"):
        assert re.search(rf"\b{cmd}\b", out), f"{cmd} missing from --help"


@pytest.mark.parametrize("service", ["gpu_manager", "agent", "dc_manager", "controller", "router"])
def test_each_service_explains_its_flags(service: str) -> None:
    r = subprocess.run([sys.executable, "-m", f"services.{service}", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--nats-url" in r.stdout and "--node" in r.stdout


@pytest.mark.parametrize("argv", [["status"], ["snapshot", "lease-x"], ["engine", "sleep", "eng-x"],
                                  ["engine", "regroup", "eng-x"]])
def test_an_admin_command_without_a_controller_says_so_in_one_line(argv: list[str]) -> None:
    port = procs.free_port()  # nothing listens there
    r = subprocess.run([*HOLDFAST, *argv, "--api-url", f"http://127.0.0.1:{port}"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"no answer from the admin API at http://127.0.0.1:{port}" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr and len(r.stdout.strip().splitlines()) <= 3


def test_up_starts_every_service_healthy_and_sigterm_leaves_no_process(tmp_path: Path) -> None:
    ports = [procs.free_port() for _ in range(4)]
    argv = [*HOLDFAST, "up", "--nats-port", str(ports[0]), "--etcd-port", str(ports[1]), "--api-port", str(ports[2]),
            "--router-port", str(ports[3]), "--base-dir", str(tmp_path / "stack"), "--backend", "host"]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"})
    lines: list[str] = []
    assert up.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "holdfast: ready" in line:
            break
    output = "".join(lines)
    assert "holdfast: ready" in output, output
    pids = [int(p) for p in re.findall(r"│\s*\w+\s*│\s*(\d+)\s*│", output)]
    assert len(pids) == 7, output  # nats, etcd and five services
    assert all(procs.pid_alive(p) for p in pids)
    status = subprocess.run([*HOLDFAST, "status", "--api-url", f"http://127.0.0.1:{ports[2]}", "--token", "holdfast-dev-admin"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert status.returncode == 0, status.stdout + status.stderr
    assert "node-1" in status.stdout
    refused = subprocess.run([*HOLDFAST, "status", "--api-url", f"http://127.0.0.1:{ports[2]}", "--token", "wrong"],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert refused.returncode == 1 and "answered 401" in refused.stdout and "Traceback" not in refused.stdout + refused.stderr
    up.send_signal(signal.SIGTERM)
    up.wait(60)
    assert up.returncode == 0
    time.sleep(0.5)
    left = [p for p in pids if procs.pid_alive(p)]
    assert not left, f"still running: {left}"
    # processes started detached by the services (the fd keeper) must go too
    strays = [p for p in procs.pids_with_env("HF_STATE_DIR", str(tmp_path / "stack" / "state")) if procs.pid_alive(p)]
    assert not strays, f"processes of the stack still running: {strays}"
