from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gpu_manager.harness import Engine, ManagerProc


@pytest.fixture
def manager_factory(settings_env: dict[str, str], tmp_path: Path) -> Iterator:
    """Build (not start) gpu_manager processes on the host backend with this test's NATS/etcd prefixes."""
    made: list[ManagerProc] = []

    def make(**extra: str) -> ManagerProc:
        state = Path(settings_env["HF_STATE_DIR"])
        state.mkdir(parents=True, exist_ok=True)
        env = {**settings_env, "HF_BACKEND": "host", "HF_CHUNK_MIB": "1", "HF_RECONCILE_INTERVAL_S": "0.1", **extra}
        m = ManagerProc(env=env, state_dir=state)
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


@pytest.fixture
def manager(manager_factory) -> ManagerProc:  # noqa: ANN001
    return manager_factory().start()


@pytest.fixture
def engines() -> Iterator:
    """Start test engines (tests/gpu_manager/engine_main.py) on a manager; all are ended after the test."""
    started: list[Engine] = []

    def start(manager: ManagerProc, engine_id: str, **kw: str) -> Engine:
        e = Engine(manager.socket, engine_id, **kw)
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()


@pytest.fixture
def open_dir():
    """A directory other users may traverse (pytest's tmp dirs are private to root)."""
    d = tempfile.mkdtemp(prefix="hf-uid-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
