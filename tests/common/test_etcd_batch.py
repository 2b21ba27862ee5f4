"""`BatchWriter`: writes queued behind a pending create of their key keep their order (the create decides
what follows it), however many keys are queued at once."""

from __future__ import annotations

import asyncio

from libs.common.etcd_batch import BatchWriter
from libs.common.store import Store, encode_value


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


async def test_written_behind_writes_wait_for_an_awaited_write_and_share_its_transaction(store: Store) -> None:
    writer = BatchWriter(store, behind_linger_s=3600)  # only an awaited write (or a flush) sends them
    writer.put_nowait("k/behind1", {"v": 1})
    writer.delete_nowait("k/gone")
    await asyncio.sleep(0.05)
    assert writer.transactions == 0 and writer.pending("k/behind1") == (True, b'{"v":1}')
    await writer.put("k/awaited", {"v": 2})  # not held by the linger
    assert writer.transactions == 1  # all three in one transaction
    assert await store.get("k/behind1") == b'{"v":1}' and await store.get("k/awaited") == b'{"v":2}'
    await writer.close()


async def test_a_flush_sends_lingering_writes_at_once_and_a_linger_ends_on_its_own(store: Store) -> None:
    writer = BatchWriter(store, behind_linger_s=3600)
    writer.put_nowait("k/a", {"v": 1})
    await writer.flush()  # does not wait out the linger
    assert await store.get("k/a") == b'{"v":1}'
    await writer.close()
    writer = BatchWriter(store, behind_linger_s=0.01)
    writer.put_nowait("k/b", {"v": 1})  # nothing else comes: sent when the linger ends
    while writer.pending("k/b")[0]:
        await asyncio.sleep(0.01)
    assert await store.get("k/b") == b'{"v":1}' and writer.lingered >= 1
    await writer.close()


async def test_a_put_soon_is_queued_at_once_and_its_future_resolves_once_etcd_has_it(store: Store) -> None:
    writer = BatchWriter(store)
    done = writer.put_soon("k/soon", {"v": 1})
    assert writer.pending("k/soon")[0]  # queued before the caller yields (no task to run first)
    assert await done is True
    assert await store.get("k/soon") == b'{"v":1}'
    await writer.close()


async def test_a_full_transaction_of_creates_under_a_guard_is_within_etcds_limits(store: Store) -> None:
    # max_ops creates and the guard's comparison: 128 comparisons and 127 operations, etcd's most (--max-txn-ops).
    await store.put("guard/k", "term")
    writer = BatchWriter(store, guard=lambda t: [t.value(store.full("guard/k")) == encode_value("term")])
    created = [asyncio.ensure_future(writer.create(f"full/{i}", {"v": i})) for i in range(writer.max_ops)]
    assert all(await asyncio.gather(*created))
    assert writer.transactions == 1 and not writer.lost.is_set()
    await writer.close()


async def test_large_records_are_sent_in_transactions_etcd_accepts_and_none_is_lost(store: Store) -> None:
    """etcd refuses a request over --max-request-bytes (1.5 MiB by default): ten 400 KB records written behind at
    once, counted only by operations, made one 4 MB transaction that failed every one of them and set `lost` (a
    controller's term ended on it). Each fits, so all of them land."""
    writer = BatchWriter(store, behind_linger_s=3600)
    for i in range(10):
        writer.put_nowait(f"k/big{i}", {"v": "x" * 400_000, "i": i})
    await writer.flush()
    assert not writer.lost.is_set()
    assert writer.transactions >= 3  # at most ~1 MiB each
    for i in range(10):
        got = await store.get(f"k/big{i}")
        assert got is not None and got.endswith(b'"i":%d}' % i)
    await writer.close()
