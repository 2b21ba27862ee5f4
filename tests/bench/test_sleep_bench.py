"""`holdfast bench sleep` on the host backend, small: a real gpu_manager (with nats and etcd) and a real batched
engine process; each trial's report says what the sleep released (the manager's accounting and the memfd pages the
processes really hold), the times, and that the greedy outputs after the wake equal those before. Its pure parts:
the summary over trials and the level list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from bench.sleep import cli, parse_levels, summarize


def invoke(*args: str) -> tuple[int, dict]:
    app = typer.Typer()
    app.command()(cli)
    result = CliRunner().invoke(app, ["--backend", "host", "--json", *args])
    return result.exit_code, json.loads(result.stdout)  # stdout is the report and nothing else


@pytest.mark.timeout(600)
def test_the_sleep_bench_frees_the_kv_cache_and_wakes_with_identical_outputs(tmp_path: Path):
    code, out = invoke("--kv-cache-gib", "0.05", "--level", "1,2", "--trials", "1", "--max-tokens", "8",
                       "--dir", str(tmp_path), "--out", str(tmp_path / "sleep.json"))
    assert code == 0 and out["complete"] and json.loads((tmp_path / "sleep.json").read_text()) == out
    assert out["backend"] == "host" and out["size"] == "tiny" and out["kv_bytes"] > 0
    assert [t["level"] for t in out["trials"]] == [1, 2]
    one, two = out["trials"]
    for t in out["trials"]:
        assert t["identical"], t
        assert t["sleep_s"] > 0 and t["wake_s"] > 0 and t["engine_sleep_ms"] > 0 and t["engine_wake_ms"] > 0
        f, h = t["free_bytes"], t["held_bytes"]
        assert f["asleep"] - f["before"] == t["bytes_released"] == t["measured_released"]  # the manager's books
        assert f["after"] == f["before"] and t["bytes_mapped_on_wake"] == t["bytes_released"]
        # the processes really let the pages go: at least the KV cache's (its pages were touched by the prefill,
        # not every one of them: a memfd's untouched pages hold nothing)
        assert t["measured_held_released"] > 0 and h["asleep"] < h["before"]
    assert one["bytes_released"] >= out["kv_bytes"] and one["leases"] == 1 and one["weights_source"] is None
    assert two["bytes_released"] > one["bytes_released"] and two["weights_source"] == "host"
    s = out["summary"]
    assert set(s) == {"1", "2"} and s["1"]["identical"] and s["2"]["trials"] == 1
    assert s["1"]["wake_s"]["p50"] == one["wake_s"]
    assert not list((tmp_path).glob("*/weights-*"))  # the weights file is removed


@pytest.mark.timeout(300)
def test_an_engine_that_cannot_start_is_a_report_that_says_why(tmp_path: Path):
    code, out = invoke("--kv-cache-gib", "100000", "--trials", "1", "--dir", str(tmp_path))
    assert code == 1 and not out["complete"] and out["trials"] == []
    assert "engine did not start" in out["error"] and out["steps"][-1][0] == "done"


def test_the_summary_takes_percentiles_per_level_and_identity_over_all_trials():
    rows = [{"level": 1, "sleep_s": s, "wake_s": 2 * s, "bytes_released": 10, "measured_released": 10,
             "identical": True} for s in (0.1, 0.2, 0.3)]
    rows.append({"level": 2, "sleep_s": 1.0, "wake_s": 3.0, "bytes_released": 20, "measured_released": 18,
                 "identical": False})
    rows.append({"level": 2, "error": "CommandTimeout: no answer"})  # counted apart, no figure
    s = summarize(rows)
    assert s["1"]["trials"] == 3 and s["1"]["identical"] and s["1"]["sleep_s"]["p50"] == pytest.approx(0.2)
    assert s["1"]["wake_s"]["max"] == pytest.approx(0.6) and s["1"]["engine_wake_ms"]["p50"] is None
    assert not s["2"]["identical"] and s["2"]["measured_released"]["p50"] == 18
    assert s["2"]["trials"] == 1 and s["2"]["failed"] == 1 and s["1"]["failed"] == 0
    assert summarize([{"level": 1, "error": "x"}])["1"] == {**summarize([{"level": 1, "error": "x"}])["1"],
                                                           "trials": 0, "failed": 1, "identical": False}


@pytest.mark.parametrize("bad", ["3", "x", "", "1,0"])
def test_a_bad_level_is_refused(bad: str):
    with pytest.raises(ValueError):
        parse_levels(bad)
    assert parse_levels("1,2") == [1, 2]
