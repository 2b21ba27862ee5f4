"""`holdfast bench restore`: only the sources named are timed (the speed of light always is), each still checked
against the file's bytes; an unknown source is refused before anything starts; the CLI prints one complete JSON
report (and rewrites `--out` after every step); a source that fails is named in the report with its error while
the others are measured; a peer library that is not installed is said to be skipped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from bench.restore import SOURCES, cli, goals, parse_sources, run


def app() -> typer.Typer:
    a = typer.Typer()
    a.command()(cli)
    return a


def test_only_the_sources_named_are_timed_and_each_restores_the_files_bytes(tmp_path: Path):
    out = run("host", 0.0625, tmp_path, trials=1, workers=2, sources=("host",))
    assert out["verified"] == {"host": True} and out["host_path"] == "in place"
    assert set(out["gib_s"]) == {"sol_direct_read", "host"} and all(v > 0 for v in out["gib_s"].values())
    assert out["complete"] and out["errors"] == {} and "error" not in out
    assert not any(tmp_path.iterdir())


def test_source_lists_are_parsed_and_an_unknown_one_is_refused():
    assert parse_sources("all") == SOURCES and parse_sources("host, file") == ("host", "file")
    assert parse_sources("host,artifact,file") == ("host", "artifact-direct", "file")  # the spelling
    for bad in ("disk", "", "host,nope"):
        with pytest.raises(ValueError, match="known"):
            parse_sources(bad)
    result = CliRunner().invoke(app(), ["--backend", "host", "--sources", "nope"])
    assert result.exit_code == 2 and "--sources" in result.output


def test_the_cli_prints_one_complete_report_with_every_figure_and_writes_it_as_it_goes(tmp_path: Path):
    report = tmp_path / "restore.json"
    result = CliRunner().invoke(app(), ["--backend", "host", "--weights-gib", "0.0625", "--dir", str(tmp_path),
                                        "--trials", "2", "--workers", "2", "--from", "all", "--no-first-token", "--json",
                                        "--out", str(report)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)  # stdout is the report and nothing else
    assert out["complete"] and out["errors"] == {} and json.loads(report.read_text()) == out
    fast = out["peers"]["fastsafetensors"]
    timed = {"file", "safetensors", "sol_direct_read", "artifact-buffered", "artifact-direct", "host"}
    if fast["installed"]:
        timed.add("fastsafetensors")
    else:  # said, not silently left out
        assert out["skipped"]["fastsafetensors"].startswith("not installed")
    assert set(out["gib_s"]) == timed == set(out["seconds"]) and all(v > 0 for v in out["gib_s"].values())
    assert out["skipped"]["host-bounce"].startswith("cuda only")
    assert out["verified"] == {"file": True, "artifact-buffered": True, "artifact-direct": True, "host": True}
    g = out["goals"]
    assert g["artifact_share_of_direct_read"]["share"] > 0 and g["host_120gib_extrapolated"]["restore_s"] > 0
    assert [s for s, _ in out["steps"]][-1] == "done" and not list(tmp_path.glob("hf-bench-restore-*"))


def test_a_source_that_fails_is_reported_and_the_others_are_measured(tmp_path: Path):
    def corrupt(report: dict[str, Any]) -> None:  # once the host tier has its copy: the artifact's bytes go bad
        if report["steps"][-1][0] == "host tier copied":
            data = next(Path(report["dir"]).glob("data-*.bin"))
            with open(data, "r+b") as f:
                f.write(b"\xff" * 4096)

    out = run("host", 0.0625, tmp_path, trials=2, workers=2, sources=("artifact-direct", "host"), progress=corrupt)
    assert set(out["errors"]) == {"artifact-direct"} and "ArtifactInvalid" in out["errors"]["artifact-direct"]
    assert out["verified"] == {"host": True} and out["gib_s"]["host"] > 0 and out["complete"]
    assert "artifact-direct" not in out["gib_s"] and "artifact_share_of_direct_read" not in out["goals"]
    result = CliRunner().invoke(app(), ["--backend", "nope", "--weights-gib", "0.0625", "--dir", str(tmp_path),
                                        "--json"])
    assert result.exit_code == 1  # the run itself failed: still a report, saying why
    bad = json.loads(result.stdout)
    assert not bad["complete"] and bad["error"] and bad["gib_s"] == {}


def test_the_goals_are_read_from_the_figures():
    g = goals({"gib": 16, "gib_s": {"sol_pinned_h2d": 50.0, "host": 45.0, "sol_direct_read": 2.0,
                                    "artifact-direct": 1.5, "fastsafetensors": 1.6}})
    assert g["host_share_of_pinned_h2d"] == {"share": 0.9, "goal": 0.8, "met": True}
    assert g["artifact_share_of_direct_read"] == {"share": 0.75, "goal": 0.8, "met": False}
    assert not g["artifact-direct_vs_fastsafetensors"]["met"] and g["host_vs_fastsafetensors"]["met"]
    assert g["host_120gib_extrapolated"] == {"restore_s": 2.67, "from_gib": 16, "goal_s": 5.0, "met": True}
    assert goals({"gib": 1, "gib_s": {"sol_direct_read": 1.0}}) == {}
