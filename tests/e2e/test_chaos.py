"""A smoke chaos run with a fixed seed: one fault of every kind under load on the batched engine, then every
invariant holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.chaos_run import FAULTS

ZERO = {"corrupted": 0, "leaked": 0, "two_writers": 0, "replicas_exceeded": 0, "lost": 0, "wrong": 0,
        "unresolved": 0, "ended_twice": 0, "manager_unserved": 0, "stale_routes": 0}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_smoke_run_of_every_fault_kind_keeps_every_invariant() -> None:
    env = {**os.environ, "HF_FORCE_NO_GPU": "1"}
    # the batched engine in deterministic mode: every output through every fault equals the no-failure run's
    r = subprocess.run([sys.executable, "-m", "holdfast.main", "chaos", "--smoke", "--gap", "1", "--seed", "7",
                        "--engine", "batched", "--json"], capture_output=True, text=True, timeout=900, env=env)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON report; stderr:\n{r.stderr[-4000:]}"
    report = json.loads(lines[-1])
    assert report["invariants"] == ZERO, report
    assert r.returncode == 0
    assert set(report["faults"]) == set(FAULTS), report["faults"]
    assert not report["skipped"], report["skipped"]  # each kind landed, none passed over
    assert report["requests"]["ok"] > 0
