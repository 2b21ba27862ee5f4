"""`holdfast bench recovery --streams N --gpu-fault` (bench/load_recovery.py `run_gpu_fault`) on the whole stack
(real nats, etcd, gpu_manager, agent, controller, dc_manager, router) of a node of two simulated GPUs: the active
batched engine's GPU fails under 8 streams and 2 late requests, twice (the second fault a few seconds after the
first, on the other GPU: no crash-loop backoff holds the second recovery), two of its ways side by side. With its KV
backed up to host and a spare on the other GPU, the spare continues every stream from the backup (the second trial's
spare one the agent started on the replaced GPU): nothing lost, every output the no-failure run's, no prompt
prefilled again. Without a backup, a cold start replays every stream through the router: nothing lost either, but
every prompt is prefilled again (what the backup saves). The third way (the backup, a cold engine taking it over)
runs whole in tests/e2e/test_kv_backup_gpu_fault.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.load_recovery import run_gpu_fault


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_gpu_fault_under_load_is_continued_by_a_spare_from_the_backup_and_replayed_without_one(tmp_path: Path) -> None:
    report = await run_gpu_fault(backend="host", size="tiny", streams=8, late=2, trials=2, max_tokens=96,
                                 kv_cache_gib=None, work_dir=tmp_path, ways=("spare", "replay"))
    ways = report["ways"]
    for way in ("spare", "replay"):
        control, failed = ways[way]["no_failure"], ways[way]["failure"]
        assert control["lost"] == 0 and control["requests"] == 10, (way, control)
        assert failed["lost"] == 0 and failed["mismatched"] == 0 and failed["requests"] == 20, (way, failed)
        assert failed["largest_gap_ms"]["n"] == 16 and failed["late_first_token_ms"]["n"] == 4
    backup, replay = ways["spare"]["failure"]["successor"], ways["replay"]["failure"]["successor"]
    assert backup["recomputed_tokens"] == 0  # no prompt prefilled again (the lag's tokens are fed: claim_extra_tokens)
    assert [r["source"] for r in backup["recovery"]] == ["backup"] * 2
    assert all(r["kv_backup"]["restored"] >= 1 for r in backup["recovery"])
    assert replay["recomputed_tokens"] > 0  # every replayed prompt prefilled again
