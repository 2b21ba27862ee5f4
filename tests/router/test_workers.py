"""Several router processes behind one port (services/router/workers.py), with real NATS, etcd, pattern engines and
router processes killed with real signals: streams spread over the workers and survive an engine's SIGKILL on every
worker; `/stats` answers for the whole router; a dead worker is started again while the others serve; the workers
die with worker 0."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from libs.common import procs
from libs.common.bus import Bus
from libs.common.store import Store
from services.router.workers import _bind_public, loopback_of, merge_stats
from tests.engine.support import EngineProc, generate, pattern_engine
from tests.router.conftest import TOKEN_INTERVAL_S
from tests.router.test_router import (
    announce,
    assert_one_complete_stream,
    retire,
    stream_lines,
    wait_for_table,
)

WORKERS = 3


def test_merged_stats_sum_counters_join_recent_lists_and_keep_the_answering_workers_views() -> None:
    own = {"requests": 3, "cpu_s": 1.5, "route_ins": [{"engine_id": "a"}], "endpoints": {"m": [{"inflight": 2}]},
           "spare_connections": {"open": 4, "taken": 1}, "loop_late": None, "worker": 0, "pid": 10, "ok": True}
    other = {"requests": 4, "cpu_s": 0.25, "route_ins": [{"engine_id": "b"}], "endpoints": {"m": [{"inflight": 5}]},
             "spare_connections": {"open": 6, "taken": 2}, "loop_late": None, "worker": 1, "pid": 11, "ok": False}
    merged = merge_stats([own, other])
    assert merged["requests"] == 7 and merged["cpu_s"] == 1.75
    assert merged["route_ins"] == [{"engine_id": "a"}, {"engine_id": "b"}]
    assert merged["spare_connections"] == {"open": 10, "taken": 3}
    assert merged["endpoints"] == own["endpoints"]  # each worker's view of one table: not added up
    assert (merged["worker"], merged["pid"], merged["ok"], merged["loop_late"]) == (0, 10, True, None)
    assert merge_stats([own]) == own and merge_stats([]) == {}
    # the workers' own ports listen on loopback whatever the public address
    assert (loopback_of("0.0.0.0"), loopback_of("::"), loopback_of("10.1.2.3")) == ("127.0.0.1", "::1", "127.0.0.1")


def worker_pids(router: Any) -> dict[int, int]:
    return {w["worker"]: w["pid"] for w in router.stats()["workers"] if "pid" in w}


def wait_workers(router: Any, n: int, timeout: float = 60) -> dict[int, int]:
    """Until every worker answers /stats (a guard against hanging, not a performance figure)."""
    deadline = time.monotonic() + timeout
    while len(pids := worker_pids(router)) != n:
        assert time.monotonic() < deadline, router.stats()["workers"]
        time.sleep(0.1)
    return pids


@pytest.fixture
def roomy_engines(tmp_path: Path) -> Iterator[Callable[[str], EngineProc]]:
    """Pattern engines that run 16 streams at once (conftest's run 4): every stream in flight at the kill."""
    started: list[EngineProc] = []

    def start(engine_id: str) -> EngineProc:
        started.append(pattern_engine(tmp_path, engine_id, args=("--slots", "16", "--token-interval-s",
                                                                 TOKEN_INTERVAL_S)).start())
        return started[-1]

    yield start
    for e in started:
        e.stop()


async def test_streams_spread_over_the_workers_and_survive_an_engines_sigkill_on_each(
        roomy_engines, start_router, bus: Bus, store: Store) -> None:
    a, b = roomy_engines("wk-a"), roomy_engines("wk-b")
    await asyncio.gather(asyncio.to_thread(a.wait_ready), asyncio.to_thread(b.wait_ready))
    router = await asyncio.to_thread(start_router, router_workers=WORKERS)
    await asyncio.to_thread(wait_workers, router, WORKERS)
    await announce(bus, store, a.engine_id, a.url)
    await asyncio.to_thread(wait_for_table, router, {a.engine_id})
    prompts = [f"worker stream {i}" for i in range(12)]
    expected = {p: generate(b.url, prompt=p, max_tokens=150, ignore_eos=True)["tokens"] for p in prompts}

    seen = [asyncio.Event() for _ in prompts]
    # one client a stream: each its own connection, accepted by whichever worker takes it
    clients = [httpx.AsyncClient(timeout=60) for _ in prompts]
    try:
        tasks = [asyncio.create_task(stream_lines(c, router.url, {"prompt": p, "max_tokens": 150, "ignore_eos": True},
                                                  s, after=5))
                 for c, p, s in zip(clients, prompts, seen, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in seen)), 60)
        a.child.kill(signal.SIGKILL)
        await retire(bus, store, a.engine_id, "killed")
        await announce(bus, store, b.engine_id, b.url, predecessor_id=a.engine_id)
        results = await asyncio.gather(*tasks)
    finally:
        for c in clients:
            await c.aclose()
    for p, lines in zip(prompts, results, strict=True):
        assert_one_complete_stream(lines, expected[p])
        assert lines[-1]["engines"][-1] == b.engine_id
    stats = router.stats()
    assert stats["completed"] == len(prompts) and stats["failed"] == 0 and stats["replayed"] >= len(prompts)
    assert len(stats["workers"]) == WORKERS and all("error" not in w for w in stats["workers"])
    served = [w["requests"] for w in stats["workers"]]
    assert sum(served) == stats["requests"] >= len(prompts)
    assert sum(1 for n in served if n > 0) >= 2, stats["workers"]  # the streams were spread, not all on one loop
    own = httpx.get(router.url + "/stats", params={"scope": "worker"}, timeout=5).json()
    assert "workers" not in own and own["requests"] in served


async def test_a_dead_worker_is_started_again_while_the_others_serve(engines, start_router, store: Store) -> None:
    a = engines("wk-restart")
    await asyncio.to_thread(a.wait_ready)
    await store.put("endpoints/tiny-ref/wk-restart", a.url)
    router = await asyncio.to_thread(start_router, router_workers=WORKERS)
    before = await asyncio.to_thread(wait_workers, router, WORKERS)
    os.kill(before[1], signal.SIGKILL)  # a worker started by the router's worker 0
    async with httpx.AsyncClient(timeout=30) as c:
        for i in range(6):  # served meanwhile, by the workers still up
            r = await c.post(router.url + "/v1/generate", json={"model": "tiny-ref", "prompt": f"meanwhile {i}",
                                                                "max_tokens": 4})
            assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while (after := worker_pids(router)).get(1) in (None, before[1]) or len(after) != WORKERS:
        assert time.monotonic() < deadline, router.stats()["workers"]
        await asyncio.sleep(0.2)
    assert after[0] == before[0] and after[2] == before[2]  # the others went on


async def test_the_workers_die_with_worker_0_and_stop_with_it(start_router) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        router = await asyncio.to_thread(start_router, router_workers=WORKERS)
        pids = await asyncio.to_thread(wait_workers, router, WORKERS)
        assert pids[0] == router.child.pid
        router.child.kill(sig)
        deadline = time.monotonic() + 30
        while any(procs.pid_alive(pids[i]) for i in range(1, WORKERS)):
            assert time.monotonic() < deadline, f"workers outlived worker 0's {sig!r}"
            await asyncio.sleep(0.1)
        assert router.child.proc is not None
        await asyncio.to_thread(router.child.proc.wait, 10)


async def test_the_public_port_is_bound_once_a_predecessors_workers_let_it_go_and_refused_if_they_never_do() -> None:
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    asyncio.get_running_loop().call_later(0.3, held.close)  # the predecessor's last worker dies
    sock = await _bind_public("127.0.0.1", port, wait_s=10)
    sock.close()
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    try:
        with pytest.raises(OSError) as e:
            await _bind_public("127.0.0.1", other.getsockname()[1], wait_s=0.3)
        assert e.value.errno == errno.EADDRINUSE
    finally:
        other.close()
