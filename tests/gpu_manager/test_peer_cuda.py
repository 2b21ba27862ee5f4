"""The cuda path of a peer restore (issue 22, item 5): a weights lease on GPU 0, hashed after its commit, copied
device to device into a new lease on GPU 1 (cuMemcpyPeerAsync) with identical bytes. Marked `gpu`; it needs two
GPUs and is skipped below two (no such machine was lent when it was written: it has not run yet)."""

from __future__ import annotations

import asyncio

import pytest

from libs.client.memory import MemoryClient
from libs.common.errors import NotFound
from tests.gpu_manager.harness import until
from tests.gpu_manager.test_restore_cuda import SIZE, _weights  # a weights lease of SIZE on GPU 0, class cls

pytestmark = pytest.mark.gpu


def _two_gpus() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.device_count() >= 2


@pytest.mark.skipif(not _two_gpus(), reason="a peer copy across GPUs needs two GPUs")
async def test_cuda_a_restore_on_gpu_1_is_copied_from_a_peer_lease_on_gpu_0(manager_factory, tmp_path):
    m = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="128", HF_ARTIFACT_DIR=str(tmp_path / "a"),
                        HF_PEER_CLASSES='["cls"]').start()
    old, lease_id, data = await asyncio.to_thread(_weights, m, "eng-gpu0")

    def restore(engine_id: str, sources: tuple[str, ...]):  # noqa: ANN202
        c = MemoryClient.connect(engine_id, socket_path=m.socket, engine_class="cls")
        lease = c.restore("cls.w", gpu=1, sources=sources)
        return c, lease.torch("uint8", (SIZE,)).cpu().clone()

    async def served() -> tuple | None:
        try:
            return await asyncio.to_thread(restore, "eng-gpu1", ("peer",))
        except NotFound:  # not hashed yet
            return None

    c, got = await until(served, timeout=120)
    assert c.last_restore["source"] == "peer" and c.last_restore["peer"]["lease"] == lease_id
    assert c.last_restore["peer"]["gpu"] == 0 and bool((got == data).all())
    c.close()
    old.close()
