"""Defects the 500-fault chaos run found (docs/benchmarks.md, Chaos), pinned where they live, for whoever fixes them.
Each is marked xfail(strict): it fails today; once fixed it passes, the strict mark fails the suite, and the mark
goes."""

from __future__ import annotations

from types import SimpleNamespace

from libs.common.cluster_view import ClusterView
from libs.common.events import EngineSpec, RecoverIntent
from services.dc_manager.steps import IntentSteps


def test_a_cold_start_fallback_runs_the_spec_of_the_incidents_model() -> None:
    # two models of one engine class on a node, as the chaos run serves them; the dead engine's record is gone
    view = ClusterView()
    for model in ("demo-2", "demo"):
        spec = EngineSpec(engine_class="reference", model=model, command=["serve", model])
        view.agent_specs[f"node-1/{model}_reference_1"] = spec.model_dump(mode="json")
    intent = RecoverIntent(incident_id="inc-demo-gone-g0", engine_id="demo-gone", model="demo",
                           engine_class="reference", memory_lost=True, node="node-1")
    steps = SimpleNamespace(view=view, settings=SimpleNamespace(specs={}))
    chosen = IntentSteps.spec_for(steps, intent)  # type: ignore[arg-type]
    assert chosen is not None and chosen.model == "demo"
