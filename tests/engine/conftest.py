"""Fixtures for engine tests: a tiny weights file and a real gpu_manager process (host backend)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.common import procs
from libs.common.config import CommonSettings
from tests.agent.conftest import agent, recorder  # noqa: F401 - the agent fixtures, reused by test_standby
from tests.engine.support import make_tiny_weights


@pytest.fixture
def tiny_weights(tmp_path: Path) -> Path:
    return make_tiny_weights(tmp_path / "weights" / "tiny.safetensors")


def end_processes_of(state_dir: Path) -> None:
    """Processes started detached for this test (the gpu_manager's fd keeper, engines) carry its unique
    state dir in their environment: end them so none outlives the test."""
    procs.kill_pids_with_env("HF_STATE_DIR", str(state_dir))


def start_gpu_manager(settings: CommonSettings, settings_env: dict[str, str], tmp_path: Path) -> procs.Child:
    """A real gpu_manager on the host backend, once its engine socket exists."""
    settings.ensure_state_dir()
    sock = settings.state_dir / "gpu_manager.sock"
    child = procs.Child("gpu_manager", [sys.executable, "-m", "services.gpu_manager"],
                        env={**settings_env, "HF_BACKEND": "host", "HF_GRACE_S": "120", "PYTHONUNBUFFERED": "1"},
                        log_path=tmp_path / "gpu_manager.log").start()
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert child.alive(), (tmp_path / "gpu_manager.log").read_text()
        assert time.monotonic() < deadline, "gpu_manager socket never appeared"
        time.sleep(0.05)
    return child


@pytest.fixture
def gpu_manager(settings: CommonSettings, settings_env: dict[str, str], tmp_path: Path) -> Iterator[Path]:
    """A real gpu_manager on the host backend; yields its engine socket."""
    child = start_gpu_manager(settings, settings_env, tmp_path)
    yield settings.state_dir / "gpu_manager.sock"
    child.stop()
    end_processes_of(settings.state_dir)
