"""`holdfast bench restore`'s first-token part (issue 21) on the host backend, small: a real gpu_manager (with nats and
etcd) and a new batched engine process per source; each source has its times to ready and to the first token, the
engine says it loaded from the source asked for, and the lease fill of that source sits beside it. A copy the engine
refuses (a corrupt artifact: it reads the file instead) is an error of the run, not a figure. Its pure parts: which
engine sources a source list times, the summary, the side-by-side rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from bench.first_token import engine_sources, side_by_side, summarize
from bench.restore import cli, run


@pytest.mark.timeout(600)
def test_every_source_has_its_first_token_time_from_the_source_asked_for(tmp_path: Path):
    app = typer.Typer()
    app.command()(cli)
    report = tmp_path / "restore.json"
    result = CliRunner().invoke(app, ["--backend", "host", "--weights-gib", "0.0625", "--dir", str(tmp_path),
                                      "--trials", "1", "--workers", "2", "--from", "artifact,host", "--json",
                                      "--out", str(report)])  # the first token is timed by default
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["complete"] and out["errors"] == {} and json.loads(report.read_text()) == out
    ft = out["first_token"]
    assert ft["sources"] == ["file", "artifact", "host"] and ft["errors"] == {} and ft["warmup_s"] > 0
    assert [t["source"] for t in ft["trials"]] == ["file", "host", "artifact"]
    for t in ft["trials"]:
        assert t["engine_source"] == t["source"], t  # the engine's own word on what served it
        assert t["spawn_to_ready_s"] > 0 and t["ready_to_first_token_s"] > 0 and t["load_ms"] > 0
        assert t["total_s"] == pytest.approx(t["spawn_to_ready_s"] + t["ready_to_first_token_s"], abs=2e-4)
    by = {t["source"]: t for t in ft["trials"]}
    assert by["file"]["restore"] is None and by["host"]["restore"]["bytes"] == ft["copies"]["host"]["bytes"] > 0
    assert ft["copies"]["host"]["registered_at_write"] is False and by["host"]["restore"]["register_s"] == 0.0  # host
    assert by["artifact"]["restore"]["direct_io"] in (0.0, 1.0) and set(ft["copies"]) == {"artifact", "host"}
    s = ft["summary"]
    assert all(s[x]["matches"] and s[x]["trials"] == 1 for x in ("file", "artifact", "host"))
    rows = out["side_by_side"]
    assert {x: r["fill_source"] for x, r in rows.items()} == {"file": "file", "artifact": "artifact-direct",
                                                               "host": "host"}
    for source, r in rows.items():  # the lease fill (the file's is the reference load, timed always) beside it
        assert r["fill_s"] == out["seconds"][r["fill_source"]] > 0 and r["to_first_token_s"] == by[source]["total_s"]
    assert [s for s, _ in out["steps"]][-2:] == ["first token: done", "done"]
    assert not list(tmp_path.glob("hf-bench-restore-*"))


@pytest.mark.timeout(600)
def test_an_artifact_the_engine_refuses_is_an_error_not_a_figure(tmp_path: Path):
    def corrupt(report: dict[str, Any]) -> None:  # once the artifact is written: its bytes go bad
        if report["steps"][-1][0] == "first token: artifact copy written":
            data = next(Path(report["dir"]).glob("first-token/artifacts/ft-artifact.weights/data-*.bin"))
            with open(data, "r+b") as f:
                f.write(b"\xff" * 4096)

    out = run("host", 0.0625, tmp_path, trials=1, workers=2, sources=("artifact-direct",), progress=corrupt,
              first_token=True)
    why = out["errors"]["first_token:artifact"]
    assert why.startswith("asked for artifact, the engine loaded from file") and "artifact_invalid" in why
    t = out["first_token"]["trials"][-1]
    assert t["source"] == "artifact" and t["engine_source"] == "file"
    assert not out["first_token"]["summary"]["artifact"]["matches"] and "first_token:file" not in out["errors"]


def test_the_engine_sources_are_the_file_and_those_asked_for_that_an_engine_can_load_from():
    assert engine_sources(("artifact-direct", "host", "host-bounce")) == ["file", "artifact", "host"]
    assert engine_sources(("host", "file")) == ["file", "host"]
    assert engine_sources(("safetensors", "fastsafetensors", "artifact-buffered", "host-bounce")) == ["file"]


def test_the_summary_and_the_side_by_side_rows_are_read_from_the_trials():
    rows = [{"source": "host", "engine_source": "host", "spawn_to_ready_s": s, "ready_to_first_token_s": 0.1,
             "total_s": s + 0.1, "load_ms": 100.0} for s in (1.0, 3.0, 2.0)]
    rows.append({"source": "host", "engine_id": "x", "error": "RuntimeError: gone"})
    rows.append({"source": "file", "engine_source": "file", "spawn_to_ready_s": 9.0, "ready_to_first_token_s": 0.2,
                 "total_s": 9.2, "load_ms": 5000.0})
    s = summarize(rows)
    assert s["host"]["trials"] == 3 and s["host"]["matches"] and s["host"]["spawn_to_ready_s"] == {"p50": 2.0,
                                                                                                  "max": 3.0}
    assert s["file"]["total_s"]["p50"] == 9.2
    rows[0]["engine_source"] = "file"
    assert not summarize(rows)["host"]["matches"] and summarize(rows)["host"]["engine_sources"] == ["file", "host"]
    report = {"first_token": {"summary": s}, "seconds": {"host": 0.5}, "gib_s": {"host": 32.0}}
    assert side_by_side(report) == {
        "host": {"fill_source": "host", "fill_s": 0.5, "fill_gib_s": 32.0, "engine_load_ms": 100.0,
                 "to_ready_s": 2.0, "to_first_token_s": 2.1},
        "file": {"fill_source": "file", "fill_s": None, "fill_gib_s": None, "engine_load_ms": 5000.0,
                 "to_ready_s": 9.0, "to_first_token_s": 9.2}}


@pytest.mark.parametrize(("args", "named"), [(["--weights-gib", "-1"], "--weights-gib"),
                                             (["--weights-gib", "nan"], "--weights-gib"),
                                             (["--weights-gib", "inf"], "--weights-gib"),
                                             (["--workers", "-3"], "--workers")])
def test_a_size_or_worker_count_that_is_none_is_refused_before_anything_runs(tmp_path: Path, args: list[str],
                                                                            named: str) -> None:
    """`--workers -3` ran and reported `workers: -3` beside its GiB/s; `nan` was a raw ValueError."""
    app = typer.Typer()
    app.command()(cli)
    result = CliRunner().invoke(app, ["--backend", "host", "--dir", str(tmp_path / "none"), *args])
    assert result.exit_code == 2 and named in result.output, result.output
    assert not (tmp_path / "none").exists()
