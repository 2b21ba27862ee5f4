"""A single batched engine's GPU fails under load and its KV backup carries every stream on (issue 22, the rest of
item 4; docs/kv_backup.md): the whole stack (nats, etcd, gpu_manager, agent, controller, dc_manager, router; real
processes) on a node of two simulated GPUs, one engine on GPU 0 with `--kv-backup`, greedy streams through the
router. GPU 0 is marked failed (what an NVML XID does): the engine's weights and cache are lost with it, its backup
(host memory) is not. The incident goes to the fallback (no memory to reattach); the dc_manager freezes the backup
alone (`Freeze(backups_only)`) and starts a cold engine on GPU 1 that takes it over (`TakeoverReq(cold_weights)`),
loads the weights itself and restores every sequence from the backup. Every stream ends with the uninterrupted
run's tokens, none lost or twice, no prompt prefilled again.

Again with a spare (EngineSpec.spares): a standby on GPU 1 that loaded its own weights and leased its own cache at its
start. The fallback hands the backup to it instead of starting a cold engine: it restores every sequence into its
cache and serves, with no process started, no weights loaded and no cache leased in the outage."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from libs.common.events import EngineInfo, Tag
from tests.e2e.test_tp_incident import started
from tests.e2e.test_tp_kv_backup_incident import (
    STREAMS,
    BackedGroupScenario,
    gpu_failed,
    through_a_gpu_fault,
)


class BackedSingle(BackedGroupScenario):
    tp = 1


class BackedWithSpare(BackedSingle):
    spares = 1
    spec_gpus = (0, 1)


async def wait_spare(sc: BackedSingle, timeout: float = 180.0) -> EngineInfo:
    """The spec's spare, warm (its weights loaded, standing by)."""
    deadline = time.monotonic() + timeout
    while True:
        spares = [e for e in await sc.engines() if e.spare and e.state == "standby"]
        if spares:
            return spares[0]
        assert time.monotonic() < deadline, f"no spare standing by: {await sc.engines()}"
        await asyncio.sleep(0.1)


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


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("agent_restarted", [False, True], ids=["spare", "spare-after-agent-restart"])
async def test_a_spare_on_another_gpu_takes_the_kv_backup_over_when_the_engines_gpu_fails(
        tmp_path: Path, agent_restarted: bool) -> None:
    """`agent_restarted`: the node's agent SIGKILLed and started again while the spare stands by: the new agent
    adopts it back as a spare (its record says so), neither a second spare nor an extra standby to stop."""
    sc = BackedWithSpare(size="tiny", backend="host", standbys=0, work_dir=tmp_path, shadow=False)
    try:
        faults = await started(sc)
        engine = await sc.wait_serving(standbys=0, timeout=180)
        spare = await wait_spare(sc)
        if agent_restarted:
            assert sc.stack is not None
            sc.stack.kill("agent")
            await asyncio.to_thread(sc.stack.restart, "agent")
            await asyncio.sleep(3.0)  # its first reconcile passes: a wrong count would start or stop an engine here
            assert (await wait_spare(sc)).engine_id == spare.engine_id  # the same spare, still a spare
            live = [e for e in await sc.engines() if e.state in ("starting", "standby", "ready")]
            assert sorted(e.engine_id for e in live) == sorted([engine.engine_id, spare.engine_id]), live
        assert (engine.gpu, spare.gpu) == (0, 1) and spare.role == "standby"  # a GPU of its own
        held = [i for i in (await sc.leases()).leases if i.owner == spare.engine_id]
        assert sorted((i.tag, i.gpu) for i in held) == [(Tag.KV_CACHE, 1), (Tag.WEIGHTS, 1)]  # its own, on GPU 1
        marked, out = await gpu_failed(sc, engine, 0)
        engines = await sc.engines()
    finally:
        await sc.close()
        await asyncio.to_thread(sc.stop)
    results, control, record, successor, health = out.results, out.control, out.record, out.successor, out.health
    assert marked.engines == [engine.engine_id] and {f.engine_id for f in faults} == {engine.engine_id}
    assert [r.error for r in results] == [None] * STREAMS and all(r.done for r in results)
    assert [r.tokens for r in results] == [r.tokens for r in control]  # none lost, none twice, the same tokens
    assert [i.id for i in out.incidents] == [record["id"]] and record["state"] == "resolved" and record["fallback"]
    assert successor.engine_id == spare.engine_id and successor.gpu == 1  # the spare, no process started
    assert successor.role == "active" and not successor.spare and successor.successor_of == engine.engine_id
    fallback = record["steps"]["fallback"]["detail"]
    assert fallback.startswith("weights of a spare, loaded before the fault") and "; KV from host backup: " in fallback
    restore, stats = health["recovery"]["kv_backup"], health["engine"]
    assert health["memory"]["source"] == "backup" and restore["source"] == "restored" and restore["restored"] >= 1
    assert stats["recomputed_tokens"] == 0  # no request prefilled again
    (backup,) = [i for i in out.before if i.owner == engine.engine_id and i.tag is Tag.OTHER]
    mine = {i.id: i for i in out.after if i.owner == successor.engine_id}
    assert backup.id in mine and mine[backup.id].host  # the very backup lease, handed on
    assert {i.id for i in held} <= set(mine)  # the weights and cache it held before the fault, still its own
    assert {i.gpu for i in mine.values() if not i.host} == {1}
    assert not [i for i in out.after if i.owner == engine.engine_id]
    # GPU 0 failed and GPU 1 serves: no GPU of the spec is left for another spare
    assert not [e for e in engines if e.spare and e.state in ("starting", "standby")]
    print(f"a spare after a GPU fault: {record['steps']['fallback']}, ready in {health['recovery']['ready_ms']} ms")  # noqa: T201
