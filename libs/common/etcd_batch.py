"""`BatchWriter`: etcd writes grouped into transactions (group commit), awaited or written behind.

Each etcd write costs a gRPC round trip and a raft commit; at hundreds of incidents a second those calls,
not the bytes, are what a Python process spends its time on. The writer collects the writes of every
caller and sends them as one transaction of up to `max_ops` operations (etcd's default limit is 128):

- `create(key, value)` (put only if absent) and `put(key, value)` wait until their transaction is
  committed: use them for what safety needs before acting (an incident's opening, a command's progress);
  `create_soon` and `put_soon` queue one and return its future (a caller with many awaits them together).
- `put_nowait` / `delete_nowait` return at once (DESIGN.md section 4: record the other steps without
  waiting); a later write to the same key replaces a pending one, so only the latest value is sent.
- `put_after(key, value, delay_s)` queues a put only after `delay_s`, and drops it when a newer write of
  the key comes first: a state that usually lasts less than that is then never written at all.
- `pending(key)` is the value this process wrote last and etcd may not have yet: read it before etcd
  so a reader in this process never sees an older record than the one it wrote.

Fencing: every transaction also carries the `guard` comparisons (the controller passes "the leader key
still names me"); a failed guard fails every write of that transaction and sets `lost`, which the owner
treats as losing its right to write. Keys are never in two transactions at once, so writes to one key are
applied in the order they were made.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from libs.common.errors import Conflict
from libs.common.store import Store, encode_value

log = logging.getLogger("holdfast.etcd_batch")

PUT, CREATE, DELETE = "put", "create", "delete"


@dataclass
class _Op:
    kind: str
    key: str
    obj: Any  # what the caller passed; encoded only when sent or read (a superseded write never is)
    waiters: list[asyncio.Future[bool]] = field(default_factory=list)
    _raw: bytes | None = None

    @property
    def value(self) -> bytes | None:
        if self.kind == DELETE:
            return None
        if self._raw is None:
            self._raw = encode_value(self.obj)
        return self._raw


class BatchWriter:
    def __init__(self, store: Store, *, guard: Callable[[Any], list[Any]] | None = None, max_ops: int = 127,
                 max_bytes: int = 1 << 20, parallel: int = 4, behind_linger_s: float = 0.0) -> None:
        self.store = store
        # Written-behind writes with nothing awaited beside them wait up to this long for company: an awaited
        # write (or `max_ops` writes) sends them at once. 0: sent as soon as a slot is free.
        self.behind_linger_s = behind_linger_s
        self._urgent = False  # an awaited write (or a flush) is pending: no lingering
        self._hurry: asyncio.Future[None] | None = None  # the linger's wait, ended early by an urgent write
        self.guard = guard  # (transactions helper) -> comparisons added to every transaction
        # 127: etcd refuses a transaction with more than 128 (--max-txn-ops) operations or comparisons; its
        # comparisons are the guard's one and one per create. In a burst most transactions are full: 100 made
        # ~15% more of them (docs/controlplane.md), each a gRPC request, a raft entry and a watch response.
        self.max_ops = max_ops
        # And at most this many bytes of keys and values (but one write, whatever its size): etcd refuses a request
        # over --max-request-bytes (1.5 MiB by default), so a few large records in one transaction failed the others
        # beside them (a failed written-behind batch ends the owner's term: `lost`).
        self.max_bytes = max_bytes
        self.parallel = parallel
        self.lost = asyncio.Event()
        self.transactions = 0  # committed transactions (health and benchmarks)
        # Told of every write as it is sent: (key, encoded value or None for a delete, the object given). The
        # controller's view uses it to take its own records from the watch without parsing them again.
        self.on_send: Callable[[str, bytes | None, Any], None] | None = None
        self._pending: dict[str, _Op] = {}
        self._deferred: dict[str, tuple[asyncio.TimerHandle, _Op]] = {}  # put_after's writes, not yet due
        self.deferred_dropped = 0  # put_after writes superseded before they were due (never sent)
        self._later: list[_Op] = []  # writes to a key that has a create pending (kept in order)
        self._later_keys: dict[str, int] = {}  # key -> its writes in _later (no scan of _later per write)
        self.lingered = 0  # transactions that waited for company (health and benchmarks)
        self._inflight: dict[str, _Op] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._running = 0
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ writes

    async def create(self, key: str, value: Any) -> bool:
        """Put only if `key` is absent; True when this write created it."""
        return await self._wait(self._add(_Op(CREATE, key, value)))

    def create_soon(self, key: str, value: Any) -> asyncio.Future[bool]:
        """`create` queued now, its outcome awaited later (many creates of one caller, one wait each, no task)."""
        fut = self._add(_Op(CREATE, key, value))
        assert fut is not None
        return fut

    async def put(self, key: str, value: Any) -> None:
        await self._wait(self._add(_Op(PUT, key, value)))

    def put_soon(self, key: str, value: Any) -> asyncio.Future[bool]:
        """`put` queued now, its confirmation awaited later (no task per write); `value` as for `put_nowait`."""
        fut = self._add(_Op(PUT, key, value))
        assert fut is not None
        return fut

    def put_nowait(self, key: str, value: Any) -> None:
        """Queue a put; `value` is encoded when it is sent, so it must not be changed after this call."""
        self._add(_Op(PUT, key, value), wait=False)

    def delete_nowait(self, key: str) -> None:
        self._add(_Op(DELETE, key, None), wait=False)

    def put_after(self, key: str, value: Any, delay_s: float) -> None:
        """Queue a put of `value` in `delay_s`, unless another write of `key` is made before (this one is then
        dropped). Like `put_nowait`, `value` must not be changed after this call."""
        self._drop_deferred(key)
        handle = asyncio.get_running_loop().call_later(delay_s, self._fire_deferred, key)
        self._deferred[key] = (handle, _Op(PUT, key, value))

    def _fire_deferred(self, key: str) -> None:
        entry = self._deferred.pop(key, None)
        if entry is not None:
            self._add(entry[1], wait=False)

    def _drop_deferred(self, key: str) -> None:
        entry = self._deferred.pop(key, None)
        if entry is not None:
            entry[0].cancel()
            self.deferred_dropped += 1

    def pending(self, key: str) -> tuple[bool, bytes | None]:
        """(True, value) when this process has a write of `key` not yet confirmed (value None: a delete)."""
        deferred = self._deferred.get(key)
        if deferred is not None:
            return True, deferred[1].value
        for op in reversed(self._later):
            if op.key == key:
                return True, op.value
        found = self._pending.get(key) or self._inflight.get(key)
        return (False, None) if found is None else (True, found.value)

    async def flush(self) -> None:
        """Wait until every write made so far is committed (or failed); writes not yet due are sent now."""
        for key in list(self._deferred):
            self._deferred[key][0].cancel()
            self._fire_deferred(key)
        while self._pending or self._later or self._running:
            self._hasten()
            self._ensure_task()
            self._wake.set()
            self._idle.clear()
            await self._idle.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # ------------------------------------------------------------ plumbing

    def _add(self, op: _Op, *, wait: bool = True) -> asyncio.Future[bool] | None:
        if self._deferred:
            self._drop_deferred(op.key)  # a newer write of the key: the one not yet due is never sent
        fut = asyncio.get_running_loop().create_future() if wait else None
        if fut is not None:
            op.waiters.append(fut)
            self._hasten()
        cur = self._pending.get(op.key)
        if (cur is not None and (cur.kind == CREATE or op.kind == CREATE)) or op.key in self._later_keys:
            self._later.append(op)  # a create decides what follows it: keep the order
            self._later_keys[op.key] = self._later_keys.get(op.key, 0) + 1
        elif cur is not None and op.kind != CREATE:
            op.waiters = cur.waiters + op.waiters  # the newer value supersedes the pending one
            self._pending[op.key] = op
        else:
            self._pending[op.key] = op
        self._ensure_task()
        self._wake.set()
        return fut

    def _hasten(self) -> None:
        self._urgent = True
        if self._hurry is not None:
            _wake(self._hurry)

    async def _linger(self) -> None:
        """Only written-behind writes are pending: give later writes `behind_linger_s` to join them (one
        transaction, one raft commit and one gRPC call for all), unless an awaited one comes first."""
        loop = asyncio.get_running_loop()
        self._hurry = hurry = loop.create_future()
        timer = loop.call_later(self.behind_linger_s, _wake, hurry)
        try:
            await hurry
        finally:
            timer.cancel()
            self._hurry = None
        self.lingered += 1

    async def _wait(self, fut: asyncio.Future[bool] | None) -> bool:
        assert fut is not None
        return await fut

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="etcd-batch-writer")

    async def _run(self) -> None:
        slots = asyncio.Semaphore(self.parallel)
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.behind_linger_s > 0 and self._pending and not self._urgent and len(self._pending) < self.max_ops:
                await self._linger()
            self._urgent = False
            while self._pending or self._later:
                self._promote_later()
                batch = self._take()
                if not batch:
                    break  # every pending key is in flight: its transaction's end wakes us
                await slots.acquire()
                self._running += 1
                task = asyncio.get_running_loop().create_task(self._commit(batch, slots))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if not self._running:
                self._idle.set()

    def _promote_later(self) -> None:
        if not self._later:
            return
        keep: list[_Op] = []
        kept: dict[str, int] = {}
        for op in self._later:
            if op.key in self._pending or op.key in kept:
                keep.append(op)
                kept[op.key] = kept.get(op.key, 0) + 1
            else:
                self._pending[op.key] = op
        self._later, self._later_keys = keep, kept

    def _take(self) -> list[_Op]:
        batch: list[_Op] = []
        size = 0
        for key in list(self._pending):
            if key in self._inflight:
                continue
            op = self._pending[key]
            size += len(key) + len(op.value or b"")
            if batch and size > self.max_bytes:
                break  # the next transaction's first
            batch.append(self._pending.pop(key))
            if len(batch) >= self.max_ops:
                break
        for op in batch:
            self._inflight[op.key] = op
        return batch

    async def _commit(self, batch: list[_Op], slots: asyncio.Semaphore) -> None:
        try:
            try:
                results = await self._txn(batch)
            except Exception as e:  # noqa: BLE001 - etcd unreachable: every waiter hears it, nothing is lost silently
                log.warning("etcd batch of %d failed: %s", len(batch), e)
                for op in batch:
                    for w in op.waiters:
                        if not w.done():
                            w.set_exception(e)
                if not any(op.waiters for op in batch):
                    self.lost.set()  # written-behind records could not be kept: the owner must restart
                return
            for op, ok in zip(batch, results, strict=True):
                for w in op.waiters:
                    if not w.done():
                        w.set_result(ok)
        finally:
            for op in batch:
                if self._inflight.get(op.key) is op:
                    del self._inflight[op.key]
            self._running -= 1
            slots.release()
            self._wake.set()
            if not self._running and not self._pending and not self._later:
                self._idle.set()

    async def _txn(self, batch: list[_Op]) -> list[bool]:
        """One transaction; if a create's key exists (the only per-key condition), redo each alone."""
        t = self.store.client.transactions
        guard = self.guard(t) if self.guard else []
        if self.on_send is not None:
            for op in batch:
                self.on_send(op.key, op.value, op.obj)
        creates = [t.version(self.store.full(op.key)) == 0 for op in batch if op.kind == CREATE]
        ok, _ = await self.store.client.transaction(compare=guard + creates, success=[self._req(t, op) for op in batch],
                                                    failure=[])
        self.transactions += 1
        if ok:
            return [True] * len(batch)
        if guard:
            held, _ = await self.store.client.transaction(compare=guard, success=[], failure=[])
            if not held:
                self.lost.set()
                raise Conflict("the write guard no longer holds (leadership lost?)")
        out = []
        for op in batch:
            cmp = guard + ([t.version(self.store.full(op.key)) == 0] if op.kind == CREATE else [])
            one, _ = await self.store.client.transaction(compare=cmp, success=[self._req(t, op)], failure=[])
            out.append(bool(one))
        return out

    def _req(self, t: Any, op: _Op) -> Any:
        k = self.store.full(op.key)
        return t.delete(k) if op.kind == DELETE else t.put(k, op.value)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
