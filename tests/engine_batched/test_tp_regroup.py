"""Back to a whole group (a regroup; engines/batched/degrade.py): a single batched engine with `--kv-backup` (real
gpu_manager on the host backend, two simulated GPUs, real processes) serves 4 greedy streams, each vouched for by a
backup round, and is SIGKILLed; its backup is frozen alone (`Freeze(backups_only)`, as the dc_manager freezes it)
and a TP=2 group on GPUs 0 and 1 started with `HF_TAKEOVER_FROM` + `HF_TRANSFER_TOKEN` takes it over (rank 0 alone
asks, `cold_weights`), loads its shards cold and restores every sequence, each kv head into its rank's cache: tiny
(2 kv heads, 1/1) and tiny3 (3 kv heads, 2/1). Every stream, resumed as the router resumes it, ends with the tokens
the engine would have made, no prompt prefilled again; the old backup is given back and the group holds its own
leases, registered as its gang under its own id."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engines.batched.degrade import backup_rank, describe, gathered, heads_of
from engines.reference.config import get_config
from engines.reference.tp import kv_spans
from engines.reference.weights import make_weights
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import Freeze, FreezeReply
from tests.engine.test_tp import two_gpus  # noqa: F401 - fixture
from tests.engine_batched import test_failover
from tests.engine_batched.test_failover import BatchedEngine
from tests.engine_batched.test_tp_degraded import BACKUP, continued_from_backups, leases
from tests.engine_batched.test_tp_kv_restore import streams_backed_up


def test_a_single_engines_backup_is_rank_0_of_1_and_its_heads_split_over_the_new_ranks() -> None:
    assert backup_rank("kv_backup") == (1, 0) and backup_rank("kv_backup.tp2-r1") == (2, 1)
    with pytest.raises(ValueError, match="no tensor-parallel rank's KV backup"):
        backup_rank("kv_cache")
    kv = torch.arange(4 * 2 * 2 * 2 * 3 * 2, dtype=torch.float32).reshape(4, 2, 2, 2, 3, 2)  # 4 blocks, 3 kv heads
    d = gathered({"kv_backup": {"kv_backup": kv}})
    assert (d.ranks, d.num_blocks) == (1, 4)
    with pytest.raises(ValueError, match="not one group's every rank"):  # a single engine's beside a rank's
        gathered({"kv_backup": {"kv_backup": kv}, "kv_backup.tp2-r1": {"kv_backup": kv}})
    whole, idx = get_config("tiny3"), torch.tensor([1, 3])  # 2 layers
    rows = {0: kv[idx]}
    for j in range(2):  # layer 0's heads 2/1, layer 1's 1/2: each rank's cache is units of one head, layer by layer
        got = heads_of(rows, whole, 2, j)  # [units, 2, blocks, block size, 1, dim]
        want = [kv[idx][:, layer, :, :, h:h + 1].permute(3, 1, 0, 2, 4).unsqueeze(4)
                for layer in range(2) for h in range(*kv_spans(whole, 2, layer)[j])]
        assert got.shape == (3, 2, 2, 2, 1, 2) and torch.equal(got, torch.cat(want))
    assert torch.equal(heads_of(rows, whole, 1, 0), kv[idx].permute(1, 2, 0, 3, 4, 5))  # one engine: as it was


def test_the_timeline_says_regrouped_when_more_ranks_continue_the_backups() -> None:
    info = {"restored": 4, "blocks": 8, "ms": 1.5, "recomputed_tokens": 3}
    assert describe({**info, "from_ranks": 1, "to_ranks": 2}).startswith("regrouped from one engine to 2 ranks: KV of 4")
    assert describe({**info, "from_ranks": 2, "to_ranks": 1}).startswith("degraded from 2 ranks to one engine: KV of 4")
    # a spare group of the same size (docs/multi_gpu.md "Spares")
    assert describe({**info, "from_ranks": 2, "to_ranks": 2}).startswith("a whole group again on 2 ranks: KV of 4")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", ["tiny", "tiny3"])
async def test_a_single_engine_is_continued_by_a_whole_group_from_its_kv_backup_alone(
        tmp_path: Path, two_gpus: Path, settings_env: dict[str, str], settings: CommonSettings,  # noqa: F811
        bus: Bus, monkeypatch: pytest.MonkeyPatch, size: str) -> None:
    monkeypatch.setattr(test_failover, "MAX_TOKENS", 2 * test_failover.MAX_TOKENS)  # outlive the first rounds
    weights = make_weights(get_config(size), tmp_path / f"{size}.safetensors", seed=7)
    first = BatchedEngine(tmp_path, weights, "btr-a", settings_env, "--size", size, "--num-blocks", "256", *BACKUP)
    expected, seen, threads = await streams_backed_up(first)
    first.kill()
    for t in threads:
        await asyncio.to_thread(t.join, 10)
    assert all(0 < len(s) < len(expected[i]) for i, s in seen.items()), "a stream ended before the kill"
    frozen = await bus.request(settings.node, Freeze(owner="btr-a", backups_only=True), FreezeReply)
    (old,) = frozen.leases
    assert old.name == "kv_backup" and old.host  # the backup alone: the engine's weights and cache left as they are

    group = BatchedEngine(tmp_path, weights, "btr-b", {**settings_env, "HF_TAKEOVER_FROM": "btr-a",
                                                       "HF_TRANSFER_TOKEN": frozen.transfer_token},
                          "--size", size, "--tp", "2", *BACKUP)
    try:
        info = await continued_from_backups(group, expected, seen, 1, ["btr-b", "btr-b-r1"], [0, 1], bus, settings)
        assert info["tp"]["gang"]["gang_id"] == "btr-b"  # its own id: no gang was taken over
        after = await leases(bus, settings)
        assert old.id not in {i.id for i in after}  # the old backup given back once restored
        # the engine's weights and cache, handed on to nobody, went with the backup's takeover (its GPU's room)
        assert not [(i.name, i.state) for i in after if i.owner == "btr-a"]
    finally:
        group.child.stop()
