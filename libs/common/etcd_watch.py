"""aetcd's watch multiplexer with a cancel-safe watch creation (used by `store._EtcdClient`).

aetcd's `Watcher` runs every watch of a client over one gRPC stream and creates them one at a time: a create
request is sent, and the caller waits for etcd's `created` answer. Its `add_callback` has a defect that made a
view stopped while it created its watches wait forever (1), and one that can cost a whole timeout (2):

1. It waited with `asyncio.wait_for`, which on Python 3.11 swallows a cancellation that arrives in the loop pass
   in which the awaited operation completes (CPython gh-86296, fixed in 3.12): the cancelled caller got its
   watch back and went on watching. A `ClusterView` cancelled while its heads create their watches (stopped
   right after a resync) then had a head that never ended, and whoever awaited the view waited forever.
2. A `created` answer that itself reports a compacted start revision gets its error set without its caller being
   woken (the caller would sleep out the whole timeout, 5 s). The etcd we run answers a compacted start with a
   plain `created` and then a cancel carrying the compaction, which aetcd handles, so this is a guard measured
   to cost nothing, not a delay seen here (the compaction tests take as long with and without it).

Invariants here: a cancelled creation raises `CancelledError` in its caller, always; a watch created for a caller
that was cancelled meanwhile is cancelled on etcd, not left streaming into a queue nobody reads; a compacted
start raises `RevisionCompactedError` as soon as etcd says so, whichever answer carries it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aetcd.exceptions
import aetcd.watcher


class Watcher(aetcd.watcher.Watcher):
    _new_callback: aetcd.watcher.WatcherCallback | None  # the creation in flight (aetcd's, untyped)

    async def _handle_response(self, response: Any) -> None:
        await super()._handle_response(response)
        if response.created:  # aetcd's own handling leaves a compacted creation's caller asleep (defect 2)
            async with self._lock:
                self._new_callback_ready.notify_all()

    async def add_callback(self, key: bytes, callback: Any, range_end: bytes | None = None,
                           start_revision: int | None = None, progress_notify: bool = False, kind: Any = None,
                           prev_kv: bool = False, watch_id: int | None = None,
                           fragment: bool = False) -> aetcd.watcher.WatcherCallback:
        async with self._lock:
            await self.setup()
            while self._new_callback:  # one creation in flight at a time: etcd answers them in order
                await self._new_callback_ready.wait()
            pending = aetcd.watcher.WatcherCallback(callback)
            pending.prev_kv = prev_kv
            self._new_callback = pending
            try:
                await self._enqueue_watch_create(key, range_end=range_end, start_revision=start_revision,
                                                 progress_notify=progress_notify, kind=kind, prev_kv=prev_kv,
                                                 watch_id=watch_id, fragment=fragment)
                # asyncio.timeout, not wait_for: a cancellation always reaches this caller (defect 1).
                async with asyncio.timeout(self._timeout):
                    while pending.watch_id is None and pending.error is None:
                        await self._new_callback_ready.wait()
            except TimeoutError:
                raise aetcd.exceptions.WatchTimeoutError from None
            except BaseException:
                if pending.watch_id is not None:  # created for a caller that is gone: stop it on etcd
                    self._callbacks.pop(pending.watch_id, None)
                    with contextlib.suppress(asyncio.QueueFull):  # a stream that far behind is ending anyway
                        self._request_queue.put_nowait(self._build_watch_cancel_request(pending.watch_id))
                raise
            finally:
                self._new_callback = None
                self._new_callback_ready.notify_all()
            if pending.error is not None:
                raise pending.error
            return pending
