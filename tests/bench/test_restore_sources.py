"""`holdfast bench restore`: only the sources named are timed (the speed of light always is), each still checked
against the file's bytes; a host-tier-only run writes no file and no artifact (the weights made in a lease, every
restore checked against them, its time from nothing to the lease ready measured), refuses a size the machine
cannot hold and takes the largest that fits for 0; an unknown source is refused before anything starts; the CLI
prints one complete JSON report (and rewrites `--out` after every step); a source that fails is named in the report
with its error while the others are measured; a peer library that is not installed is said to be skipped."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from bench import restore_synth
from bench.restore import SOURCES, cli, goals, parse_sources, run


def app() -> typer.Typer:
    a = typer.Typer()
    a.command()(cli)
    return a


def test_only_the_sources_named_are_timed_and_each_restores_the_files_bytes(tmp_path: Path):
    out = run("host", 0.0625, tmp_path, trials=1, workers=2, sources=("artifact-direct", "host"))
    assert out["verified"] == {"file": True, "artifact-direct": True, "host": True} and out["host_path"] == "in place"
    assert set(out["gib_s"]) == {"sol_direct_read", "artifact-direct", "host"}
    assert all(v > 0 for v in out["gib_s"].values()) and out["weights"] == "file"
    assert out["complete"] and out["errors"] == {} and "error" not in out
    assert not any(tmp_path.iterdir())


def test_a_host_only_run_writes_no_file_and_checks_each_restore_against_the_weights_it_made(tmp_path: Path):
    seen: dict[str, list[str]] = {}

    def look(report: dict[str, Any]) -> None:  # what the run's folder holds once the tier has its copy
        if report["steps"][-1][0] == "host tier copied":
            seen["files"] = [p.name for p in Path(report["dir"]).rglob("*")]

    out = run("host", 0.0625, tmp_path, trials=2, workers=2, sources=("host",), progress=look)
    assert out["complete"] and out["errors"] == {} and out["weights"] == "generated in a lease"
    assert seen["files"] == []  # no weights file, no artifact: the tier's memfds are the only copy
    assert out["verified"] == {"host": True} and set(out["gib_s"]) == {"host"}
    assert out["skipped"]["sol_direct_read"].startswith("no artifact")
    assert out["to_ready_s"]["host"] >= out["seconds"]["host"] > 0  # the lease's allocation and mapping on top
    assert out["host_only_room"]["bound"] == "host" and out["host_only_room"]["max_gib"] > out["gib"]
    assert out["goals"]["host_120gib_extrapolated"]["to_ready_s"] > 0


@pytest.mark.timeout(600)
def test_a_host_only_run_through_the_manager_restores_the_copy_its_policy_wrote(tmp_path: Path):
    out = run("host", 0.0625, tmp_path, trials=2, workers=2, sources=("host",), manager=True)
    assert out["complete"] and out["errors"] == {}, out
    m = out["manager"]
    assert m["held"] and not m["registered_at_write"]  # the host backend registers nothing
    assert m["verified"] and [t["source"] for t in m["trials"]] == ["host", "host"]
    assert all(t["registered_dma"] == 0.0 and t["register_s"] == 0.0 for t in m["trials"])
    assert m["to_ready_s"]["p50"] >= m["fill_s"]["p50"] > 0 and m["write_s"] > 0
    assert m["health_polls"] > 0 and m["health_timeouts"] == 0 and 0 < m["health_max_ms"] < 10_000
    assert out["goals"]["host_120gib_extrapolated"]["manager_to_ready_s"] > 0
    refused = run("host", 0.0625, tmp_path, trials=1, workers=2, sources=("file", "host"), manager=True)
    assert not refused["complete"] and "host-tier-only" in refused["error"]


def test_a_host_only_run_refuses_a_size_this_machine_cannot_hold_and_0_needs_a_host_only_run(tmp_path: Path):
    room = restore_synth.host_only_room(types.SimpleNamespace(name="host", free_bytes=lambda gpu: None), 0)
    too_big = (room["max_bytes"] + 2 * restore_synth.GIB) / restore_synth.GIB
    out = run("host", too_big, tmp_path, trials=1, workers=2, sources=("host",))
    assert not out["complete"] and "does not fit here" in out["error"] and out["gib_s"] == {}
    out = run("host", 0, tmp_path, trials=1, workers=2, sources=("artifact-direct", "host"))
    assert not out["complete"] and "host-tier-only run" in out["error"]


def test_the_synthetic_weights_check_sees_one_changed_byte():
    import numpy as np

    from libs.client.mapping import HostMapping

    size = 2 * restore_synth.SLICE + 4096  # two whole slices and a short one
    fd = os.memfd_create("hf-synth", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    m = HostMapping([fd], [size])
    try:
        assert not restore_synth.matches(m, size)  # zeros
        restore_synth.fill(m, size)
        assert restore_synth.matches(m, size)
        view = np.frombuffer(m.buffer(0, size), dtype=np.uint8)
        first = restore_synth.pattern(0, restore_synth.SLICE, None)
        assert not np.array_equal(first, restore_synth.pattern(1, restore_synth.SLICE, None))  # slices differ
        view[restore_synth.SLICE + 12345] ^= 1
        assert not restore_synth.matches(m, size)
    finally:
        m.unmap()
        os.close(fd)


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
    assert out["verified"] == {"file": True, "host": True} and out["gib_s"]["host"] > 0 and out["complete"]
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
