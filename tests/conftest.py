"""Shared fixtures: one real nats-server and one real etcd for the session, on free loopback ports.

Every test gets its own `settings` with a unique subject prefix, etcd prefix and stream name, so tests
share the servers without seeing each other's messages or keys.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.gpu import has_gpu
from libs.common.ids import new_id
from libs.common.store import Store

HAS_GPU = has_gpu()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU here (run on the device: scripts/device_run.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def infra_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="hf-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def nats_server(infra_dir: Path) -> Iterator[str]:
    port = procs.free_port()
    child = procs.nats_server(port, infra_dir / "nats", infra_dir / "nats.log").start()
    procs.wait_port(port, child)
    yield f"nats://127.0.0.1:{port}"
    child.stop()


@pytest.fixture(scope="session")
def etcd_server(infra_dir: Path) -> Iterator[str]:
    port, peer = procs.free_port(), procs.free_port()
    child = procs.etcd_server(port, peer, infra_dir / "etcd", infra_dir / "etcd.log").start()
    procs.wait_port(port, child)
    yield f"127.0.0.1:{port}"
    child.stop()


@pytest.fixture
def settings(nats_server: str, etcd_server: str, tmp_path: Path) -> CommonSettings:
    tag = new_id("t")
    return CommonSettings(
        nats_url=nats_server,
        etcd_endpoints=etcd_server,
        subject_prefix=tag.replace("-", ""),
        etcd_prefix=f"/{tag}/",
        stream_name=f"S{tag.replace('-', '')}",
        node="node-1",
        state_dir=tmp_path / "state",
    )


@pytest.fixture
def settings_env(settings: CommonSettings) -> dict[str, str]:
    """The same settings as environment variables, for child processes."""
    return settings.to_env()


@pytest.fixture
async def bus(settings: CommonSettings) -> AsyncIterator[Bus]:
    b = await Bus.connect(settings, "test")
    yield b
    await b.close()


@pytest.fixture
async def store(settings: CommonSettings) -> AsyncIterator[Store]:
    s = await Store.connect(settings)
    yield s
    await s.delete_prefix("")
    await s.close()
