"""`BatchWriter`: writes queued behind a pending create of their key keep their order (the create decides
what follows it), however many keys are queued at once."""

from __future__ import annotations

import asyncio

from libs.common.etcd_batch import BatchWriter
from libs.common.store import Store


async def test_writes_behind_a_pending_create_land_in_order_and_the_last_one_stays(store: Store) -> None:
    writer = BatchWriter(store)
    sent: list[tuple[str, bytes | None]] = []
    writer.on_send = lambda key, value, _obj: sent.append((key, value))
    created = [asyncio.ensure_future(writer.create(f"k/{i}", {"v": 0})) for i in range(50)]
    await asyncio.sleep(0)  # each create is queued
    for v in (1, 2):  # queued behind each key's create, in order
        for i in range(50):
            writer.put_nowait(f"k/{i}", {"v": v})
    assert all(await asyncio.gather(*created))
    await writer.flush()
    for i in range(50):
        assert await store.get(f"k/{i}") == b'{"v":2}'
        mine = [value for key, value in sent if key == f"k/{i}"]
        assert mine[0] == b'{"v":0}' and mine[-1] == b'{"v":2}'  # the create first, the newest value last
    assert not writer._later and not writer._later_keys
    await writer.close()


async def test_a_create_of_an_existing_key_fails_and_the_writes_behind_it_still_land(store: Store) -> None:
    writer = BatchWriter(store)
    assert await writer.create("k/x", {"v": 0})
    again = asyncio.ensure_future(writer.create("k/x", {"v": 9}))
    await asyncio.sleep(0)
    writer.put_nowait("k/x", {"v": 1})
    assert await again is False
    await writer.flush()
    assert await store.get("k/x") == b'{"v":1}'
    await writer.close()
