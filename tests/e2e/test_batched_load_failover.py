"""The whole stack with the batched engine under 16 concurrent streams (real nats, etcd, gpu_manager, agent with
a warm standby, controller, dc_manager, router; a real SIGKILL): every stream and every request sent during the
outage completes with the tokens of the no-failure run, the router sends them to the standby named by the
route-out before its takeover ends, the standby (shadowing the active engine's leases in its
reservations) adopts all 16 sequences from the journal and claims each resumed request, and no prefill token is
recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.load_recovery import run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
async def test_sixteen_streams_and_four_late_requests_survive_a_sigkill_through_the_router(
        tmp_path: Path, deterministic: bool) -> None:
    """In deterministic mode every output equals the no-failure run's; in the default mode (outputs depend on the
    batch) every stream still ends with exactly the tokens it asked for: none lost or repeated at the failover."""
    report = await run(backend="host", size="tiny", streams=16, late=4, trials=1, max_tokens=96,
                       kv_cache_gib=None, work_dir=tmp_path, deterministic=deterministic)
    control, failed = report["no_failure"], report["sigkill"]
    assert control["lost"] == 0 and control["requests"] == 20
    assert failed["lost"] == 0 and failed["wrong_length"] == 0 and failed["requests"] == 20
    assert failed["mismatched"] == (0 if deterministic else None)
    succ = failed["successor"]
    assert succ["adopted"] == [16] and succ["claimed"] == [16]
    assert succ["recomputed_prefill_tokens"] == 0
    assert succ["recovery"][0]["source"] == "takeover" and succ["recovery"][0]["journal"] == "adopted"
    # the standby shadowed the active engine: its leases were in the reservations before the kill, nothing mapped
    # at the takeover, and the runner built over the reservations served (engines/batched/standby.py)
    assert report["shadow"] and succ["recovery"][0]["shadowed"]
    assert succ["recovery"][0]["memory_ms"]["reserved"] == 0 and succ["recovery"][0]["prepared_runner"] == "reused"
    # the shadowed leases were granted held (no fd, no tensor sent), the prepared views taken whole
    memory_ms = succ["recovery"][0]["memory_ms"]
    assert {k: v[:2] for k, v in memory_ms["leases"].items() if k != "other:drain_mark"} == {
        "weights:weights": ["held", 0], "kv_cache:kv_cache": ["held", 0]}
    assert memory_ms["views_reused"] > 0
    # its takeover request split by the gpu_manager's marks (to it, its parse, its lease table, its grant, back)
    assert set(succ["recovery"][0]["memory_ms"]["manager_ms"]) == {"to_manager_ms", "parsed_ms", "lock_wait_ms",
                                                                   "grant_ms", "back_ms"}
    # what it prepared as a standby, in the report; no rehearsal on the CPU by default (engines/batched/rehearsal.py)
    assert succ["prepared"][0]["buckets"] == [] and "rehearsal" not in succ["prepared"][0]
    # the route-out named the shadow the likely successor, and the router sent it requests before it was added
    # (services/router/sync.py `_promise`; the standby held them until it served: engines/batched/server.py)
    assert "router promised" in failed["timeline_ms"][0]
    # the fault the agent published names our signal and the way it saw the death (pidfd.py: poll, death mark, pidfd)
    detected, = failed["detected_as"]
    assert detected.startswith("signal SIGKILL (") and detected.endswith(")"), detected
    # the host it ran on, in the report (bench/machine.py): figures from two hosts are not comparable without it
    assert report["machine"]["cpus_usable"] >= 1 and report["machine"]["cpu"] and report["machine"]["gpus"] == []
