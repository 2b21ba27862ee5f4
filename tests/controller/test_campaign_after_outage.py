"""A controller that lost its term to an etcd outage campaigns again as soon as etcd answers, not after the backoff's
doublings taken while etcd was away: a 7 s outage left no leader for 6-15 s after etcd was back, incidents waiting and
routers reading etcd's stale level meanwhile (probe of 2026-12-07). Its own etcd (not the session's), SIGSTOPped."""

from __future__ import annotations

import asyncio
import contextlib
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


class _FencedTerm:
    """A term that finds itself fenced out (its writes refused) 0.1 s in, as one does when etcd stalls."""

    def __init__(self) -> None:
        self.lost = asyncio.Event()

    def tasks(self) -> dict:
        async def work() -> None:
            await asyncio.sleep(0.1)
            self.lost.set()
            await asyncio.sleep(3600)

        return {"work": work()}

    async def stop(self) -> None:
        pass


async def test_terms_lost_to_etcd_one_after_another_do_not_grow_the_pause(store: Store) -> None:
    """Repeated etcd stalls 25 s apart had grown the pause to 15 s: the next term began 15 s after etcd answered
    (probe of 2026-12-07). A term lost to etcd (its lease, a fenced write) campaigns again after the first pause."""
    from libs.common.store import LeaderElection
    from services.controller.leadership import lead_forever

    starts: list[float] = []

    async def begin() -> _FencedTerm:
        starts.append(time.monotonic())
        return _FencedTerm()

    election = LeaderElection(store, "test-fenced-terms", "c1")
    leading = asyncio.create_task(lead_forever(election, begin, lambda _: None))
    try:
        deadline = time.monotonic() + 30
        while len(starts) < 6:
            assert time.monotonic() < deadline, starts
            await asyncio.sleep(0.05)
    finally:
        leading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leading
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert max(gaps) < 3.0, gaps  # a doubling backoff: 0.5, 1, 2, 4, 8 s
