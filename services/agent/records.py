"""etcd records of this node's engines and of the node itself.

- `engines/<node>/<id>`: EngineInfo JSON, written in the order the agent decided the changes (one writer task),
  never on the detection path: a FaultDetected is published before its record is written. Keyed by node so
  that etcd's RBAC lets a node's agent write its own engines' records and no other node's (security/policy.py).
- `nodes/<node>`: NodeInfo bound to the agent's etcd lease, refreshed by `KeepAlive`; a SIGKILLed agent
  stops refreshing and etcd deletes the key after the lease's ttl.
- `agents/<node>/specs/<key>`: specs received over NATS, so a restarted agent keeps running them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from libs.common.backoff import Backoff
from libs.common.errors import NotFound
from libs.common.events import EngineInfo, EngineSpec, GpuRecord, NodeInfo, engine_record_key
from libs.common.gpu import GpuEntry, resolve_gpu
from libs.common.store import KeepAlive, Lease, Store

log = logging.getLogger("holdfast.agent.records")


class RecordWriter:
    """Applies record changes in order from one task; a failed write is retried, later ones wait."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._queue: asyncio.Queue[tuple[str, EngineInfo | EngineSpec | None]] = asyncio.Queue()

    def put_engine(self, info: EngineInfo) -> None:
        self._queue.put_nowait((engine_record_key(info.node, info.engine_id), info))

    def delete_engine(self, node: str, engine_id: str) -> None:
        self._queue.put_nowait((engine_record_key(node, engine_id), None))

    def put_spec(self, node: str, key: str, spec: EngineSpec) -> None:
        self._queue.put_nowait((f"agents/{node}/specs/{key}", spec))

    async def flushed(self) -> None:
        await self._queue.join()

    async def run(self) -> None:
        while True:
            key, value = await self._queue.get()
            try:
                backoff = Backoff(first_s=0.2, max_s=5.0, jitter=0.2)
                while True:
                    try:
                        if value is None:
                            await self.store.delete(key)
                        else:
                            await self.store.put(key, value)
                        if backoff.failures:
                            log.info("etcd write of %s done after %d failed tries", key, backoff.failures)
                        break
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:  # noqa: BLE001 - etcd away or full: keep the order, retry
                        # backed off to 5 s, said once a key: a full etcd (its NOSPACE alarm, minutes until an
                        # operator cures it) was a warning and a write every 200 ms (probe of 2026-12-07)
                        if not backoff.failures:
                            log.warning("etcd write of %s failed (%s); retrying, backed off to 5 s", key, e)
                        await asyncio.sleep(backoff.next_delay())
            finally:
                self._queue.task_done()


async def load_engines(store: Store, node: str) -> list[EngineInfo]:
    out = []
    for key, raw in (await store.get_prefix(f"engines/{node}/")).items():
        try:
            info = EngineInfo.model_validate_json(raw)
        except ValueError:
            log.warning("ignoring unreadable record %s", key)
            continue
        if info.node == node:
            out.append(info)
    return out


async def load_specs(store: Store, node: str) -> dict[str, EngineSpec]:
    prefix = f"agents/{node}/specs/"
    return {k.removeprefix(prefix): EngineSpec.model_validate_json(v)
            for k, v in (await store.get_prefix(prefix)).items()}


async def load_failed_gpus(store: Store, node: str, gpus: Sequence[GpuEntry]) -> dict[int, str]:
    """The node's GPUs its gpu_manager holds failed (index -> why), from `gpus/<node>/<gpu>`, which it writes from
    its durable marks: a restarted agent places nothing there. Matched by UUID (an index may have moved)."""
    out = {}
    for key, raw in (await store.get_prefix(f"gpus/{node}/")).items():
        try:
            rec = GpuRecord.model_validate_json(raw)
            gpu = resolve_gpu(rec.uuid or rec.gpu, gpus)
        except (ValueError, NotFound) as e:
            log.warning("ignoring GPU record %s: %s", key, e)
            continue
        if not rec.healthy:
            out[gpu.index] = rec.detail or "unhealthy"
    return out


async def register_node(store: Store, info: NodeInfo, ttl: int) -> tuple[Lease, KeepAlive]:
    lease = await store.grant(ttl)
    await store.put(f"nodes/{info.node}", info, lease=lease)
    return lease, KeepAlive(store, lease)
