"""The store on a real 3-member etcd cluster (TLS, client certificates, auth on, as in production): the member
the client is connected to is killed, and reads, writes, transactions, leases and watches carry on through
the two that are left."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from devstack import clusters
from libs.common import procs
from libs.common.config import CommonSettings
from libs.common.ids import new_id
from libs.common.security import servers
from libs.common.store import KeepAlive, Store, ThreadKeepAlive, WatchEvent, grpc_target
from tests.common.test_watch_resume import watch_created
from tests.conftest import TEST_IDENTITIES, _whole_keyspace
from tests.support import wait_until


def remote_ports_in_use() -> set[int]:
    """The remote ports of this process's established TCP connections (/proc/net/tcp* by socket inode; gRPC's
    sockets are IPv6 ones holding v4-mapped addresses)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    lines = [ln for t in ("tcp", "tcp6") for ln in Path(f"/proc/net/{t}").read_text().splitlines()[1:]]
    for line in lines:
        f = line.split()
        if f[3] == "01" and f[9] in inodes:  # 01: ESTABLISHED
            ports.add(int(f[2].split(":")[1], 16))
    return ports


@pytest.fixture
def etcd_cluster(tmp_path: Path, credentials: Path) -> Iterator[tuple[tuple[clusters.Member, ...], list[procs.Child]]]:
    ms = clusters.members("etcd")
    kids = clusters.etcd_children(ms, tmp_path, tmp_path, tls_flags=servers.etcd_tls_flags(credentials))
    try:
        clusters.start(ms, kids)
        servers.etcd_setup(f"127.0.0.1:{ms[0].port}", credentials, TEST_IDENTITIES, prefix="/",
                           ranges=_whole_keyspace)
        yield ms, kids
    finally:
        for k in kids:
            k.stop()


@pytest.fixture
async def ha_store(etcd_cluster: tuple[tuple[clusters.Member, ...], list[procs.Child]],
                   credentials: Path, tmp_path: Path) -> AsyncIterator[Store]:
    ms, _ = etcd_cluster
    settings = CommonSettings(credentials_dir=credentials, etcd_endpoints=clusters.client_urls("etcd", ms),
                              etcd_prefix=f"/{new_id('t')}/", state_dir=tmp_path / "state")
    store = await Store.connect(settings, timeout=20)
    yield store
    await store.close()


async def test_the_store_carries_on_when_the_member_it_uses_is_killed(
        etcd_cluster: tuple[tuple[clusters.Member, ...], list[procs.Child]], ha_store: Store) -> None:
    ms, kids = etcd_cluster
    store = ha_store
    await store.put("before", {"n": 1})
    lease = await store.grant(2)
    thread_ka, loop_ka = ThreadKeepAlive(store, lease), KeepAlive(store, lease)
    tasks = [asyncio.create_task(thread_ka.run()), asyncio.create_task(loop_ka.run())]
    await store.put("leased", "mine", lease=lease)
    seen: list[WatchEvent] = []

    async def watch() -> None:
        async for ev in store.watch_prefix("w/"):
            seen.append(ev)

    tasks.append(asyncio.create_task(watch()))
    await wait_until(lambda: watch_created(store), what="the watch created")  # else w/1 may come before it
    await store.put("w/1", 1)
    await wait_until(lambda: len(seen) == 1)

    used = {m.port for m in ms} & remote_ports_in_use()
    assert len(used) == 1, f"the client should hold one member, holds {used}"
    victim = next(i for i, m in enumerate(ms) if m.port in used)
    kids[victim].kill()
    kids[victim].proc.wait(5)  # type: ignore[union-attr]
    t0 = time.monotonic()

    # Reads, writes and transactions at once, from a member that is left.
    assert await store.get("before") == b'{"n":1}'
    failover_s = time.monotonic() - t0
    await store.put("after", 2)
    assert await store.create("created-after", "x")
    assert not await store.create("created-after", "y")
    assert await store.cas("after", 2, 3)
    await store.put("w/2", 2)
    await wait_until(lambda: [e.key for e in seen] == ["w/1", "w/2"])  # the watch resumed, no event lost or doubled

    # The lease outlives its ttl more than twice over: both keep-alives refresh it through the others.
    refreshed = thread_ka.refreshes
    await asyncio.sleep(2 * lease.ttl + 0.5)
    assert thread_ka.refreshes > refreshed and not thread_ka.lost.is_set() and not loop_ka.lost.is_set()
    assert await store.get("leased") == b"mine"

    survivors = {m.port for i, m in enumerate(ms) if i != victim}
    assert {m.port for m in ms} & remote_ports_in_use() <= survivors
    assert failover_s < 5.0, f"the first read after the kill took {failover_s:.2f} s"
    thread_ka.stop()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_every_member_is_in_the_channel_target() -> None:
    assert grpc_target([("127.0.0.1", 1), ("127.0.0.2", 2)]) == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert grpc_target([("::1", 1), ("[::1]", 2)]) == "ipv6:[::1]:1,[::1]:2"
    assert grpc_target([("etcd.holdfast.svc", 2379)]) == "etcd.holdfast.svc:2379"  # DNS: every address it names
    assert grpc_target([("::1", 7)]) == "[::1]:7"
    with pytest.raises(ValueError, match="IP literals"):
        grpc_target([("etcd-0", 2379), ("etcd-1", 2379)])
