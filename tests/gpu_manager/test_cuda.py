"""The crash/reattach/restart/reclaim tests on the `cuda` backend, on a real GPU (skipped without one)."""

from __future__ import annotations

import pytest

from tests.gpu_manager.harness import Engine, wait_for

pytestmark = pytest.mark.gpu

N = 3 * 64 * 1024 * 1024 + 4096  # several 64 MiB chunks, last one partial (rounded to the granularity)


@pytest.fixture
def cuda_manager(manager_factory):  # noqa: ANN001
    return manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="64", HF_GRACE_S="30")


@pytest.fixture
def engines():
    started: list[Engine] = []

    def start(manager, engine_id: str) -> Engine:  # noqa: ANN001
        e = Engine(manager.socket, engine_id, backend="cuda")
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()


def _gpu_free_bytes() -> int:
    from libs.client import cuda_driver as cd

    cd.init()
    cd.primary_context(0)
    free, _ = cd.check(cd.cu.cuMemGetInfo())
    return int(free)


def test_cuda_killed_engine_memory_is_reattached_with_identical_bytes(cuda_manager, engines):
    manager = cuda_manager.start()
    first = engines(manager, "gpu-a")
    wrote = first.ask(f"write {N} 7")
    assert wrote["data"] == wrote["expected"]
    first.kill()
    second = engines(manager, "gpu-a")
    got = second.ask("attach")
    assert got["leases"] == {wrote["lease"]: 2}
    assert got["data"] == wrote["expected"]


def test_cuda_manager_killed_and_restarted_loses_nothing(cuda_manager, engines):
    manager = cuda_manager.start()
    live = engines(manager, "gpu-live")
    live_wrote = live.ask(f"write {N} 1")
    crashed = engines(manager, "gpu-crash")
    crash_wrote = crashed.ask(f"write {N} 2")
    manager.kill()
    crashed.kill()
    assert live.ask("hash")["data"] == live_wrote["expected"]
    manager.start()
    assert live.ask("reconnect") == {"ok": True}
    assert live.ask("attach")["data"] == live_wrote["expected"]
    successor = engines(manager, "gpu-crash")
    got = successor.ask("attach")
    assert got["leases"] == {crash_wrote["lease"]: 2}
    assert got["data"] == crash_wrote["expected"]


def test_cuda_orphan_is_reclaimed_and_gpu_memory_comes_back(manager_factory, engines):
    manager = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="512", HF_GRACE_S="2").start()
    size = 4 << 30
    owner = engines(manager, "gpu-gone")
    owner.ask(f"write {size} 3")
    owner.kill()
    held = _gpu_free_bytes()
    wait_for(lambda: _gpu_free_bytes() >= held + size - (256 << 20), timeout=60, interval=0.2)


async def test_cuda_a_shadow_reads_the_owners_weights_and_cannot_change_them(cuda_manager, engines, bus):
    from libs.common.events import ShareWeights, ShareWeightsReply

    manager = cuda_manager.start()
    owner = engines(manager, "gpu-owner")
    wrote = owner.ask(f"write {N} 9")
    grant = await bus.request("node-1", ShareWeights(owner="gpu-owner", grantee="gpu-shadow"), ShareWeightsReply)
    shadow = engines(manager, "gpu-shadow")
    got = shadow.ask(f"share gpu-owner {grant.share_token}")
    assert got["data"] == wrote["expected"]
    print(f"cuda read-only mapping granted by the driver: {got['read_only']}")
    if not all(got["read_only"].values()):
        pytest.skip("this driver maps device memory read-write only (the shadow then only promises not to write)")
    poked = shadow.ask("poke")
    assert poked.get("code") == "exception", poked  # the write faults on the GPU instead of landing
    assert owner.ask("hash")["data"] == wrote["expected"]
