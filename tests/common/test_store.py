"""The store against a real etcd: keys, compare-and-swap, watches, leases and leader election."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from libs.common.config import CommonSettings
from libs.common.store import KeepAlive, LeaderElection, Store
from tests.common.test_watch_resume import watch_created
from tests.support import wait_until


async def test_put_get_delete_and_prefix(store: Store) -> None:
    await store.put("nodes/n1", {"gpus": 8})
    await store.put("nodes/n2", b"raw")
    assert await store.get("nodes/n1") == b'{"gpus":8}'
    assert set(await store.get_prefix("nodes/")) == {"nodes/n1", "nodes/n2"}
    assert await store.delete("nodes/n1")
    assert not await store.delete("nodes/n1")
    assert await store.get("nodes/n1") is None
    assert await store.delete_prefix("nodes/") == 1


async def test_create_and_compare_and_swap_refuse_a_stale_writer(store: Store) -> None:
    assert await store.create("incidents/i1", {"step": "open"})
    assert not await store.create("incidents/i1", {"step": "other"})
    assert await store.cas("incidents/i1", {"step": "open"}, {"step": "freeze"})
    assert not await store.cas("incidents/i1", {"step": "open"}, {"step": "stale"})
    _, rev = await store.get_with_revision("incidents/i1")
    assert await store.cas_revision("incidents/i1", rev, {"step": "reattach"})
    assert not await store.cas_revision("incidents/i1", rev, {"step": "stale"})
    assert await store.get("incidents/i1") == b'{"step":"reattach"}'


async def test_watch_sees_puts_and_deletes_in_order(store: Store) -> None:
    seen = []

    async def watch() -> None:
        async for ev in store.watch_prefix("engines/"):
            seen.append((ev.kind, ev.key, ev.value))
            if len(seen) == 3:
                return

    task = asyncio.create_task(watch())
    await wait_until(lambda: watch_created(store), what="the watch created")
    await store.put("engines/e1", b"a")
    await store.put("engines/e1", b"b")
    await store.put("other/x", b"ignored")
    await store.delete("engines/e1")
    await asyncio.wait_for(task, 5)
    assert seen == [("put", "engines/e1", b"a"), ("put", "engines/e1", b"b"), ("delete", "engines/e1", None)]


async def test_key_bound_to_an_expired_lease_disappears(store: Store) -> None:
    lease = await store.grant(1)
    await store.put("nodes/dead", b"x", lease=lease)
    assert await store.get("nodes/dead") == b"x"
    for _ in range(60):  # no keep-alive: etcd removes the key after the ttl
        if await store.get("nodes/dead") is None:
            break
        await asyncio.sleep(0.1)
    assert await store.get("nodes/dead") is None


async def test_keep_alive_holds_a_key_past_its_ttl(store: Store) -> None:
    lease = await store.grant(1)
    await store.put("nodes/alive", b"x", lease=lease)
    ka = asyncio.create_task(KeepAlive(store, lease).run())
    await asyncio.sleep(2.5)
    assert await store.get("nodes/alive") == b"x"
    ka.cancel()


CANDIDATE = """
import asyncio, sys
from libs.common.config import CommonSettings
from libs.common.store import Store, LeaderElection
async def main():
    store = await Store.connect(CommonSettings())
    election = LeaderElection(store, "controller", sys.argv[1], ttl=1)
    await election.campaign()
    print("LEADER", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_leadership_passes_on_when_the_leaders_process_is_killed(settings: CommonSettings, settings_env: dict[str, str], store: Store) -> None:
    env = {**os.environ, **settings_env}
    first = subprocess.Popen([sys.executable, "-c", CANDIDATE, "first"], env=env, stdout=subprocess.PIPE)
    try:
        assert first.stdout is not None
        line = await asyncio.get_running_loop().run_in_executor(None, first.stdout.readline)
        assert line.strip() == b"LEADER"
        second = LeaderElection(store, "controller", "second", ttl=1)
        campaign = asyncio.create_task(second.campaign())
        await asyncio.sleep(1.5)
        assert not campaign.done(), "only one leader while the first lives"
        assert await second.leader() == "first"
        first.send_signal(signal.SIGKILL)
        await asyncio.wait_for(campaign, 10)
        assert await second.leader() == "second"
        await second.resign()
        assert await second.leader() is None
    finally:
        first.kill()
        first.wait()
