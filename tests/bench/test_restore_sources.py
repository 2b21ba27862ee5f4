"""`holdfast bench restore --sources`: only the sources named are timed (the speed of light always is), each still
checked against the file's bytes; an unknown source is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from bench.restore import SOURCES, cli, parse_sources, run


def test_only_the_sources_named_are_timed_and_each_restores_the_files_bytes(tmp_path: Path):
    out = run("host", 0.0625, tmp_path, trials=1, workers=2, sources=("host",))
    assert out["verified"] == {"host": True} and out["host_path"] == "in place"
    assert set(out["gib_s"]) == {"sol_direct_read", "host"} and all(v > 0 for v in out["gib_s"].values())
    assert not any(tmp_path.iterdir())


def test_source_lists_are_parsed_and_an_unknown_one_is_refused():
    assert parse_sources("all") == SOURCES and parse_sources("host, file") == ("host", "file")
    for bad in ("disk", "", "host,nope"):
        with pytest.raises(ValueError, match="known"):
            parse_sources(bad)
    app = typer.Typer()
    app.command()(cli)
    result = CliRunner().invoke(app, ["--backend", "host", "--sources", "nope"])
    assert result.exit_code == 2 and "--sources" in result.output
