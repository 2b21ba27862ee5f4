"""test_tp_gang.py's, test_tp_kv_restore.py's and test_tp_degraded.py's rounds on CUDA memory: a TP=2 batched group with both ranks on the
one GPU (`--tp-one-gpu`, gloo), each rank's shard and KV cache in cuda-backend leases; SIGKILLed with 4 streams in
flight (its caches lost first, in the second), its gang frozen and taken over by a new group without the weights
file; every stream ends with its uninterrupted tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.reference.config import get_config
from engines.reference.weights import make_weights
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import ListLeases, ListLeasesReply, Reclaim, ReclaimReply, Tag
from tests.engine.conftest import tiny_weights  # noqa: F401 - fixture
from tests.engine_batched import test_failover
from tests.engine_batched.test_tp_degraded import degraded_by_one_gpu
from tests.engine_batched.test_tp_gang import GROUP, gang_taken_over
from tests.engine_batched.test_tp_kv_restore import BACKED, restored_from_backups
from tests.gpu_manager.conftest import manager_factory  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(300)
async def test_a_frozen_gang_on_cuda_is_taken_over_by_a_new_group(
        tmp_path: Path, tiny_weights: Path, manager_factory, settings_env: dict[str, str],  # noqa: F811, ANN001
        settings: CommonSettings, bus: Bus) -> None:
    manager = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="2", HF_GRACE_S="120").start()
    env = {**settings_env, "HF_GPU_MANAGER_SOCKET": manager.socket}
    await gang_taken_over(tmp_path, tiny_weights, env, settings, bus,
                          (*GROUP, "--tp-one-gpu", "--device", "cuda"), gpus=(0, 0))


@pytest.mark.timeout(300)
async def test_a_groups_lost_caches_on_cuda_are_restored_from_every_ranks_host_backup(
        tmp_path: Path, tiny_weights: Path, manager_factory, settings_env: dict[str, str],  # noqa: F811, ANN001
        settings: CommonSettings, bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """test_tp_kv_restore.py's round on the GPU: each rank's cache copied to its host lease by DMA (cudaHostRegister)
    and back into the new group's caches."""
    manager = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="2", HF_GRACE_S="120").start()
    env = {**settings_env, "HF_GPU_MANAGER_SOCKET": manager.socket}
    monkeypatch.setattr(test_failover, "MAX_TOKENS", 2 * test_failover.MAX_TOKENS)
    await restored_from_backups(tmp_path, tiny_weights, env, settings, bus,
                                (*BACKED, "--tp-one-gpu", "--device", "cuda"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("size", "ranks"), [("tiny", 2), ("tiny3", 3)], ids=["tp2-to-1", "tp3-to-2"])
async def test_a_group_whose_rank_lost_its_memory_on_cuda_is_continued_by_fewer_ranks_from_the_backups(
        tmp_path: Path, manager_factory, settings_env: dict[str, str], settings: CommonSettings,  # noqa: F811, ANN001
        bus: Bus, monkeypatch: pytest.MonkeyPatch, size: str, ranks: int) -> None:
    """test_tp_degraded.py's round on the GPU (degrade.py's restore into cuda caches, over gloo): every rank on the
    one GPU, so rank 1's memory is lost by reclaiming its weights and cache by force (a second GPU would be marked
    failed)."""
    manager = manager_factory(HF_BACKEND="cuda", HF_CHUNK_MIB="2", HF_GRACE_S="120").start()
    env = {**settings_env, "HF_GPU_MANAGER_SOCKET": manager.socket}
    monkeypatch.setattr(test_failover, "MAX_TOKENS", 2 * test_failover.MAX_TOKENS)
    weights = make_weights(get_config(size), tmp_path / f"{size}.safetensors", seed=7)

    async def lose(rank: int) -> None:
        leases = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
        mine = [i for i in leases if i.owner == f"btd-a-r{rank}" and i.tag in (Tag.WEIGHTS, Tag.KV_CACHE)]
        assert len(mine) == 2
        for lease in mine:
            await bus.request(settings.node, Reclaim(lease_id=lease.id, force=True), ReclaimReply)
    await degraded_by_one_gpu(tmp_path, weights, size, ranks, env, settings, bus,
                              device=("--tp-one-gpu", "--device", "cuda"), lose=lose)
