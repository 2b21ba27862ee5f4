"""`holdfast bench controlplane` end to end on a tiny cluster (real controller, dc_manager, nats-server and etcd
processes; simulated nodes): every incident resolves, and a steady run longer than one failure per engine fails
the successors again. The figures are the benchmark's, not asserted."""

from __future__ import annotations

import json
import subprocess
import sys


def _bench(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "holdfast.main", "bench", "controlplane", "--nodes", "2",
                        "--gpus-per-node", "2", *args, "--json"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_burst_fails_each_engine_once_and_resolves_every_incident() -> None:
    out = _bench("--incidents", "100")
    assert out["mode"] == "burst" and out["engines"] == 4
    assert out["incidents"] == out["resolved"] == 4  # capped at one failure per engine
    assert out["engines_failed_again"] == 0 and out["freeze_calls"] == out["takeover_calls"] == 4
    assert out["p99_ms_by_10s"] is None  # a steady run's measure


def test_a_steady_run_past_one_failure_per_engine_fails_the_successors_again() -> None:
    out = _bench("--rate", "20", "--duration", "2")
    # 40 faults over 4 engines: each lineage fails ~10 times, each time its newest successor. An engine still in
    # its incident is never failed again (no engine ready -> `starved`, not a second fault of the same engine).
    assert out["incidents"] + out["starved"] == 40
    assert out["resolved"] == out["incidents"] >= 30
    assert out["engines_failed_again"] == out["incidents"] - 4
    assert out["takeover_calls"] == out["incidents"]
    (window,) = out["p99_ms_by_10s"]  # one 10 s window: the run's own p99
    assert window == out["latency_ms"]["p99"]
