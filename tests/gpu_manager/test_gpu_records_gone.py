"""A node that comes back with fewer GPUs (probe finding 5): a real gpu_manager on the host backend with two
simulated GPUs, SIGKILLed and started again under the same node name with one. Its record of the vanished GPU 1 is
deleted when it starts, so placement never sends an engine there; no other node's records are touched."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from libs.common.config import CommonSettings
from libs.common.events import GpuRecord
from libs.common.store import Store
from tests.gpu_manager.harness import ManagerProc
from tests.support import wait_until


def keys_are(store: Store, node: str, want: set[str]) -> Callable[[], Awaitable[bool]]:
    """Whether `node`'s GPU records in etcd are exactly `want` (for `wait_until`)."""

    async def check() -> bool:
        return set(await store.get_prefix(f"gpus/{node}/")) == want

    return check


async def test_a_manager_back_with_fewer_gpus_deletes_the_records_of_those_it_lost(
        manager_factory, store: Store, settings: CommonSettings) -> None:  # noqa: ANN001
    node = settings.node
    manager: ManagerProc = manager_factory(HF_GPUS='["0","1"]', HF_GPU_PUBLISH_INTERVAL_S="0.1").start()
    both = {f"gpus/{node}/0", f"gpus/{node}/1"}
    await wait_until(keys_are(store, node, both), what="both GPUs' records")
    # Another node whose name begins with this one's, and another node's GPU 1: neither is this manager's to delete.
    others = {f"gpus/{node}0/1": {"healthy": True}, "gpus/other/1": {"healthy": True}}
    for key, value in others.items():
        await store.put(key, value)

    manager.kill()
    since = time.time()
    manager.extra = {"HF_GPUS": '["0"]'}
    manager.start()

    async def fresh_gpu_0() -> bool:
        raw = await store.get(f"gpus/{node}/0")
        return raw is not None and GpuRecord.model_validate_json(raw).updated_at > since

    await wait_until(fresh_gpu_0, what="GPU 0's record from the restarted manager")
    await wait_until(keys_are(store, node, {f"gpus/{node}/0"}), within_s=10, what="only GPU 0's record left")
    for key in others:
        assert await store.get(key) is not None, key

