"""Fixtures of the controller's tests: an etcd of a test's own, which it may stop (SIGSTOP) without stalling the
session's."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from libs.common import procs
from libs.common.config import CommonSettings
from libs.common.store import Store
from tests.conftest import start_etcd


@pytest.fixture
def own_etcd(tmp_path: Path, credentials: Path) -> Iterator[procs.Child]:
    port, peer = procs.free_port(), procs.free_port()
    child = start_etcd(port, peer, tmp_path / "etcd", tmp_path / "etcd.log", credentials)
    child.port = port  # type: ignore[attr-defined]
    yield child
    child.kill(signal.SIGCONT)
    child.stop()


@pytest.fixture
def stall_settings(settings: CommonSettings, own_etcd: procs.Child) -> CommonSettings:
    return settings.model_copy(update={"etcd_endpoints": f"127.0.0.1:{own_etcd.port}"})  # type: ignore[attr-defined]


@pytest.fixture
async def stall_store(stall_settings: CommonSettings) -> AsyncIterator[Store]:
    s = await Store.connect(stall_settings)
    yield s
    await s.close()
