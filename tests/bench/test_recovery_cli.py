"""`holdfast bench recovery`'s options (the runs themselves: docs/benchmarks.md)."""

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import bench.load_recovery
from bench.recovery import cli


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(cli)
    return app


def test_no_secure_is_refused_with_a_gpu_fault_whose_run_is_always_secured() -> None:
    result = CliRunner().invoke(_app(), ["--no-secure", "--streams", "4", "--gpu-fault", "--backend", "host"])
    assert result.exit_code == 2
    assert "always secured" in result.output


@pytest.mark.parametrize(("flag", "secure"), [("--no-secure", False), ("--secure", True)])
def test_the_load_run_takes_secure_as_given(monkeypatch: pytest.MonkeyPatch, flag: str, secure: bool) -> None:
    """Pure option plumbing (the run itself replaced): `--streams` with `--no-secure` reaches the load run as
    plain servers, so its TLS cost can be measured in pairs."""
    seen: dict[str, Any] = {}

    async def run(**kw: Any) -> dict[str, Any]:
        seen.update(kw)
        return {"secure": kw["secure"]}

    monkeypatch.setattr(bench.load_recovery, "run", run)
    result = CliRunner().invoke(_app(), [flag, "--streams", "4", "--backend", "host"])
    assert result.exit_code == 0, result.output
    assert seen["secure"] is secure
