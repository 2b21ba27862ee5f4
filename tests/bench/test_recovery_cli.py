"""`holdfast bench recovery`'s options (the runs themselves: docs/benchmarks.md)."""

import typer
from typer.testing import CliRunner

from bench.recovery import cli


def test_no_secure_is_refused_with_streams_whose_run_is_always_secured() -> None:
    app = typer.Typer()
    app.command()(cli)
    result = CliRunner().invoke(app, ["--no-secure", "--streams", "4"])
    assert result.exit_code == 2
    assert "always secured" in result.output

