"""A second failure during the recovery: the whole stack with the batched engine under load (real nats, etcd,
gpu_manager, agent with a warm standby, controller, dc_manager, router), the active engine SIGKILLed, then its
successor SIGKILLed as soon as it serves, its adopted streams in flight. The second incident hands the same leases
on again (to a standby if one is ready by then, else a cold successor over them): every stream and every request
sent during the outage still completes with the tokens of the no-failure run, none lost or repeated. The router's
own hold is 2 s, well under a successor's start: its requests are held through each recovery because an incident
is bringing a successor in (services/router/table.py, invariant 2), not because the hold is long.
The streams are 320 tokens long: the first successor sends a stream's rest in a few hundred ms on an idle machine,
and on a loaded CI machine its /health said "ready" only after streams of 96 tokens had all ended."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.load_recovery import run


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_streams_survive_their_successor_killed_as_soon_as_it_serves(tmp_path: Path) -> None:
    report = await run(backend="host", size="tiny", streams=8, late=2, trials=1, max_tokens=320, kv_cache_gib=None,
                       work_dir=tmp_path, deterministic=True, kill_successor=True, router_hold_s=2.0)
    control, failed = report["no_failure"], report["sigkill"]
    assert control["lost"] == 0 and control["requests"] == 10
    [second] = failed["successor"]["second_kill"]
    assert second["streams_after_kill"] > 0, (
        f"every stream had ended before the second kill ({second['after_first_ms']:.0f} ms after the first): "
        "it tested nothing")
    assert failed["lost"] == 0 and failed["wrong_length"] == 0 and failed["requests"] == 10
    assert failed["mismatched"] == 0
    # the second successor continued from the same memory: no prefill recomputed for the streams it took over
    assert failed["successor"]["recomputed_prefill_tokens"] == 0
    assert failed["successor"]["recovery"][0]["source"] == "takeover"
