from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from libs.common import procs
from libs.common.bus import Bus
from libs.common.store import Store
from tests.controller.helpers import control_plane, service_env, wait_for
from tests.gpu_manager.harness import Engine, ManagerProc

ADMIN_TOKEN = "admin-secret"


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


GRACE_S = 120.0  # far beyond a test's waits: a reclaim seen there is not a deadline's


@pytest.fixture
def two_gpu_manager(manager_factory) -> ManagerProc:  # noqa: ANN001
    """A started manager with two simulated GPUs (0 and 1) and a grace of GRACE_S."""
    return manager_factory(HF_GPUS='["0","1"]', HF_GRACE_S=str(GRACE_S)).start()


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


@dataclass
class AdminApi:
    """A real controller's REST API, reached as the admin: `http` (base URL set) and `cli` (`holdfast ...` with
    `--api-url` and `--token`), for the routes that reach a node's gpu_manager."""

    url: str
    http: httpx.AsyncClient

    async def wait_lease_of(self, owner: str) -> None:
        """Until the API lists `owner`'s one lease (the controller's view has caught up with the node)."""

        async def seen() -> bool:
            r = await self.http.get("/v1/leases", params={"owner": owner})
            return r.status_code == 200 and r.json()["total"] == 1

        await wait_for(seen, what=f"{owner}'s lease in the API's view")

    async def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "holdfast.main", *args, "--api-url", self.url, "--token", ADMIN_TOKEN]
        return await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60)


@pytest.fixture
async def admin_api(bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> AsyncIterator[AdminApi]:
    """A controller with its REST API on a free loopback port (no dc_manager), stopped after the test."""
    port = procs.free_port()
    env = service_env(settings_env, HF_API_ENABLED="true", HF_API_PORT=str(port), HF_ADMIN_TOKEN=ADMIN_TOKEN)
    async with control_plane(bus, store, env, tmp_path, dc_manager=False):
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
            yield AdminApi(url, http)


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    return tmp_path / "artifacts"


@pytest.fixture
def copies_manager(manager_factory, artifacts: Path):  # noqa: ANN001
    return manager_factory(HF_ARTIFACT_DIR=str(artifacts), HF_ARTIFACT_BLOCK_BYTES=str(1 << 20),
                           HF_ARTIFACT_FILE_BYTES=str(2 << 20), HF_SNAPSHOT_CLASSES='["auto-snap"]').start()
