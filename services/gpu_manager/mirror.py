"""Off the critical path: every lease change becomes a `LeaseChanged` event and a write of
`allocations/<node>/<lease>` in etcd (RECLAIMED leases are deleted there: etcd mirrors the live table).

A queue and one task, so a reply to an engine never waits on NATS or etcd; the changes of one lease are
applied in the order they happened. A failed publish is logged and retried a few times, then dropped: the
durable truth is the SQL table, and `resync` (at start) rewrites the whole etcd mirror from it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from libs.common.bus import Bus
from libs.common.events import LeaseChanged, LeaseInfo, LeaseState, MemoryFrozen
from libs.common.store import Store

log = logging.getLogger("holdfast.gpu_manager.mirror")
RETRIES = 3


def allocation_key(node: str, lease_id: str) -> str:
    return f"allocations/{node}/{lease_id}"


@dataclass(frozen=True)
class _Change:
    lease: LeaseInfo
    from_state: LeaseState | None
    cause: str


class Mirror:
    def __init__(self, bus: Bus | None, store: Store | None, node: str) -> None:
        self.bus = bus
        self.store = store
        self.node = node
        self.queue: asyncio.Queue[_Change | MemoryFrozen] = asyncio.Queue()

    def lease_changed(self, lease: LeaseInfo, from_state: LeaseState | None, cause: str) -> None:
        self.queue.put_nowait(_Change(lease, from_state, cause))

    def frozen(self, event: MemoryFrozen) -> None:
        self.queue.put_nowait(event)

    async def run(self) -> None:
        while True:
            item = await self.queue.get()
            for attempt in range(RETRIES):
                try:
                    await self._apply(item)
                    break
                except Exception as e:  # noqa: BLE001 - the mirror must outlive a NATS or etcd hiccup
                    log.warning("mirror attempt %d failed: %r", attempt + 1, e)
                    await asyncio.sleep(0.1 * (attempt + 1))
            self.queue.task_done()

    async def drain(self) -> None:
        await self.queue.join()

    async def _apply(self, item: _Change | MemoryFrozen) -> None:
        if isinstance(item, MemoryFrozen):
            if self.bus is not None:
                await self.bus.emit(item, incident_id=item.incident_id)
            return
        if self.store is not None:
            key = allocation_key(self.node, item.lease.id)
            if item.lease.state == LeaseState.RECLAIMED:
                await self.store.delete(key)
            else:
                await self.store.put(key, item.lease)
        if self.bus is not None:
            await self.bus.emit(LeaseChanged(lease=item.lease, from_state=item.from_state, cause=item.cause))

    async def resync(self, live: list[LeaseInfo]) -> None:
        """Make etcd hold exactly the live leases of this node."""
        if self.store is None:
            return
        prefix = f"allocations/{self.node}/"
        keep = {allocation_key(self.node, info.id) for info in live}
        for key in (await self.store.get_prefix(prefix)).keys():
            if key not in keep:
                await self.store.delete(key)
        for info in live:
            await self.store.put(allocation_key(self.node, info.id), info)
