"""A single batched engine's GPU fails under load and its KV backup carries every stream on (issue 22, the rest of
item 4; docs/kv_backup.md): the whole stack (nats, etcd, gpu_manager, agent, controller, dc_manager, router; real
processes) on a node of two simulated GPUs, one engine on GPU 0 with `--kv-backup`, greedy streams through the
router. GPU 0 is marked failed (what an NVML XID does): the engine's weights and cache are lost with it, its backup
(host memory) is not. The incident goes to the fallback (no memory to reattach); the dc_manager freezes the backup
alone (`Freeze(backups_only)`) and starts a cold engine on GPU 1 that takes it over (`TakeoverReq(cold_weights)`),
loads the weights itself and restores every sequence from the backup. Every stream ends with the uninterrupted
run's tokens, none lost or twice, no prompt prefilled again."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.common.events import Tag
from tests.e2e.test_tp_kv_backup_incident import STREAMS, BackedGroupScenario, through_a_gpu_fault


class BackedSingle(BackedGroupScenario):
    tp = 1


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_an_engine_whose_gpu_failed_is_continued_on_another_gpu_from_its_kv_backup(tmp_path: Path) -> None:
    sc = BackedSingle(size="tiny", backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    engine, faults, marked, out = await through_a_gpu_fault(sc, 0)
    assert engine.gpu == 0 and marked.engines == [engine.engine_id]
    results, control, record, successor, health = out.results, out.control, out.record, out.successor, out.health
    assert [r.error for r in results] == [None] * STREAMS and all(r.done for r in results)
    assert [r.tokens for r in results] == [r.tokens for r in control]  # none lost, none twice, the same tokens
    assert faults and {f.engine_id for f in faults} == {engine.engine_id}
    assert [i.id for i in out.incidents] == [record["id"]] and record["engine_id"] == engine.engine_id  # one incident
    assert record["fallback"] and record["state"] == "resolved"
    fallback = record["steps"]["fallback"]["detail"]  # how the weights came, and the KV
    assert fallback.startswith("weights from ") and "; KV from host backup: " in fallback, fallback
    assert successor.gpu == 1  # on the GPU left
    restore, stats = health["recovery"]["kv_backup"], health["engine"]
    assert health["memory"]["source"] == "backup" and restore["source"] == "restored" and restore["restored"] >= 1
    assert health["memory"]["weights"]["source"] in ("file", "host", "artifact")  # loaded by the successor itself
    assert stats["recomputed_tokens"] == 0  # no request prefilled again
    assert stats["prefill_tokens"] == restore["recomputed_tokens"] + stats["claim_extra_tokens"]
    (backup,) = [i for i in out.before if i.owner == engine.engine_id and i.tag is Tag.OTHER]
    mine = {i.id: i for i in out.after if i.owner == successor.engine_id}
    assert backup.id in mine and mine[backup.id].host  # the very backup lease, handed on and kept writing
    assert {i.gpu for i in mine.values() if not i.host} == {1}
    assert not [i for i in out.after if i.owner == engine.engine_id]  # nothing of the lost engine left
    print(f"KV backup after a GPU fault: {record['steps']['fallback']}")  # noqa: T201
