"""A controller that lost its term to an etcd outage campaigns again as soon as etcd answers, not after the backoff's
doublings taken while etcd was away: a 7 s outage left no leader for 6-15 s after etcd was back, incidents waiting and
routers reading etcd's stale level meanwhile (probe of 2026-12-07). Its own etcd (not the session's), SIGSTOPped."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from libs.common import procs
from libs.common.config import CommonSettings
from libs.common.security import servers
from libs.common.store import Store
from services.controller.leadership import pause
from tests.conftest import TEST_IDENTITIES, _whole_keyspace


@pytest.fixture
async def own_etcd(tmp_path: Path, credentials: Path,
                   settings: CommonSettings) -> AsyncIterator[tuple[Store, procs.Child]]:
    port, peer = procs.free_port(), procs.free_port()
    child = procs.etcd_server(port, peer, tmp_path / "etcd", tmp_path / "etcd.log",
                              tls_flags=servers.etcd_tls_flags(credentials)).start()
    procs.wait_port(port, child)
    servers.etcd_setup(f"127.0.0.1:{port}", credentials, TEST_IDENTITIES, prefix="/", ranges=_whole_keyspace)
    store = await Store.connect(settings.model_copy(update={"etcd_endpoints": f"127.0.0.1:{port}"}))
    try:
        yield store, child
    finally:
        await store.close()
        child.stop()


async def test_a_pause_ends_once_an_etcd_that_was_away_answers_and_waits_its_whole_delay_otherwise(
        own_etcd: tuple[Store, procs.Child]) -> None:
    store, child = own_etcd
    t0 = time.monotonic()
    await pause(store, 1.0, probe_s=0.2)  # etcd there throughout: the whole delay, no early campaign
    assert time.monotonic() - t0 >= 1.0
    os.kill(child.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        waiting = asyncio.create_task(pause(store, 30.0, probe_s=0.2))
        await asyncio.sleep(1.5)
        assert not waiting.done()
    finally:
        os.kill(child.pid, signal.SIGCONT)
    await asyncio.wait_for(waiting, 10)
    assert time.monotonic() - t0 < 10  # was the backoff's 30 s
