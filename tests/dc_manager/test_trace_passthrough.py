"""Without a span exporter the dc_manager builds no spans, yet its node commands and results stay in the
incident's trace (the intent's traceparent is passed on as is)."""

from __future__ import annotations

from pathlib import Path

from opentelemetry import trace

from devstack.simcluster import SimulatedCluster
from libs.common.bus import Bus
from libs.common.events import Freeze, FreezeReply, IntentResult, RecoverIntent
from libs.common.store import Store
from tests.controller.helpers import healthy, service_env, start, wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


async def test_node_commands_and_results_carry_the_intents_trace_when_nothing_exports_spans(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    sim = SimulatedCluster(bus, store, nodes=1, gpus_per_node=1, emit_events=False)
    await sim.populate()
    seen: list[str] = []
    freeze = sim.freeze

    async def traced_freeze(cmd: Freeze) -> FreezeReply:
        ctx = trace.get_current_span().get_span_context()  # the node side makes the command's context current
        seen.append(f"{ctx.trace_id:032x}" if ctx.is_valid else "")
        return await freeze(cmd)

    sim.freeze = traced_freeze  # type: ignore[method-assign]
    await sim.serve()
    dcm = start("services.dc_manager", service_env(settings_env), tmp_path / "dcm.log")  # no HF_OTEL_ENDPOINT
    try:
        await healthy(bus, "dc_manager", "dc-1")
        victim = sim.engine_id("n0000", 0)
        env = bus.envelope(RecoverIntent(incident_id="inc-t", engine_id=victim, model="m", node="n0000", gpu=0),
                           traceparent=f"00-{TRACE_ID}-00f067aa0ba902b7-01")
        await bus.publish(env)

        async def results() -> list[str] | None:
            got = [e for e in await bus.replay("intent.result") if isinstance(e.data, IntentResult)]
            done = any(e.data.step == "reattach" for e in got)  # type: ignore[union-attr]
            return [e.trace.traceparent or "" for e in got] if done else None

        parents = await wait_for(results, what="the intent's result")
        assert seen == [TRACE_ID]
        assert all(p.split("-")[1] == TRACE_ID for p in parents)
    finally:
        dcm.stop()
