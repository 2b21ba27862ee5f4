"""`BatchWriter.put_after`: a record of a state that usually lasts less than a moment is written only if it
still stands after that moment (the controller's waiting states); a newer write drops it unsent."""

from __future__ import annotations

from libs.common.etcd_batch import BatchWriter
from libs.common.store import Store
from tests.controller.helpers import wait_for


async def test_a_deferred_put_superseded_before_it_is_due_is_never_sent(store: Store) -> None:
    writer = BatchWriter(store)
    sent: list[tuple[str, bytes | None]] = []
    writer.on_send = lambda key, value, _obj: sent.append((key, value))
    writer.put_after("incidents/a", {"state": "freezing"}, 30.0)
    assert writer.pending("incidents/a") == (True, b'{"state":"freezing"}')  # readers here see it at once
    await writer.put("incidents/a", {"state": "resolved"})
    await writer.flush()
    assert sent == [("incidents/a", b'{"state":"resolved"}')]
    assert await store.get("incidents/a") == b'{"state":"resolved"}'
    assert writer.deferred_dropped == 1
    await writer.close()


async def test_a_deferred_put_still_standing_when_due_is_written(store: Store) -> None:
    writer = BatchWriter(store)
    writer.put_after("incidents/b", {"state": "freezing"}, 0.05)
    got = await wait_for(lambda: store.get("incidents/b"), what="the deferred put written")
    assert got == b'{"state":"freezing"}' and writer.deferred_dropped == 0
    await writer.close()


async def test_flush_sends_a_deferred_put_at_once(store: Store) -> None:
    writer = BatchWriter(store)
    writer.put_after("incidents/c", {"state": "fallback"}, 3600.0)
    await writer.flush()  # a clean stop keeps what is queued, due or not
    assert await store.get("incidents/c") == b'{"state":"fallback"}'
    await writer.close()
