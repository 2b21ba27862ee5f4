"""KV sleep/wake on the cuda backend (issue 21): the sleeping lease's device memory is freed (NVML says so), the
engine keeps its VA reservation, a wake maps new memory at the same device addresses, and a CUDA graph captured
before the sleep replays correctly into it after the wake; a weights lease (level 2) comes back with its bytes."""

from __future__ import annotations

import pytest

from libs.client.memory import MemoryClient

pytestmark = pytest.mark.gpu
MIB = 1024 * 1024
KV = 1024 * MIB


def nvml_used_bytes() -> int:
    """NVML's used memory of GPU 0 (nvidia-ml-py, the `gpu` extra); where it is not installed, the driver's own
    figure (total - cuMemGetInfo's free), which NVML reports the same way."""
    try:
        import pynvml
    except ImportError:
        from libs.client import cuda_driver as cd

        cd.init()
        cd.primary_context(0)
        free, total = cd.check(cd.cu.cuMemGetInfo())
        return int(total) - int(free)
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def cuda_manager(manager_factory, tmp_path):  # noqa: ANN001
    return manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="256", HF_GRACE_S="30",
                           HF_HOST_TIER_BYTES=str(512 * MIB), HF_ARTIFACT_DIR=str(tmp_path / "a")).start()


def test_cuda_sleep_frees_device_memory_and_a_graph_replays_after_wake(cuda_manager):
    import torch

    c = MemoryClient.connect("eng-cuda-sleep", socket_path=cuda_manager.socket)
    kv = c.allocate(KV, tag="kv_cache", name="kv")
    w = c.allocate(64 * MIB, tag="weights", name="w")
    cache, weights = kv.torch("float32", (KV // 4,)), w.torch("float32", (16 * MIB,))
    weights.copy_(torch.arange(16 * MIB, dtype=torch.float32, device=cache.device))
    c.register([kv.meta("kv", "float32", (KV // 4,)), w.meta("w", "float32", (16 * MIB,))])
    c.commit()
    kv_ptr, w_ptr = kv.ptr, w.ptr

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    cache.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        cache[: 16 * MIB].add_(weights)  # reads the weights lease, writes the KV lease: both addresses baked in
    graph.replay()
    torch.cuda.synchronize()
    expected = weights.clone()
    assert torch.equal(cache[: 16 * MIB], expected)

    used = nvml_used_bytes()
    slept = c.sleep([kv.id, w.id])  # level 2: the weights go to the host tier first
    assert slept.bytes == KV + 64 * MIB
    freed = used - nvml_used_bytes()
    assert freed >= KV, f"NVML: {freed} bytes freed, {KV} expected at least"

    assert c.wake([kv.id, w.id]) == "host"
    assert kv.ptr == kv_ptr and w.ptr == w_ptr  # the same device addresses
    assert nvml_used_bytes() - (used - freed) >= KV
    assert torch.equal(weights, expected)  # restored from the host tier
    cache.zero_()  # the KV content is gone (new memory): the graph's target is written again
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(cache[: 16 * MIB], expected)
    del cache, weights, graph
    c.close()
