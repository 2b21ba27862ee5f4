"""`holdfast bench recovery`'s report of one way (pure: trials as the scenario records them)."""

from __future__ import annotations

from bench.recovery import _way_report
from devstack.scenario import Trial


def _trial(kill: float, first: float, added_ms: float) -> Trial:
    return Trial(t_kill=kill, first_token=first, results=[], lost=0, mismatched=0, incident_id="i",
                 timeline_ms={"detected": 1.5, "endpoint added": added_ms, "first token after recovery": (first - kill) * 1000},
                 weights_before="w", weights_after="w",
                 engine_recovery={"first_generation": {"slot": 14.123456}, "continued": {"generations": 1, "early": 1}})


def test_each_trial_keeps_its_own_timeline_beside_the_medians() -> None:
    trials = [_trial(100.0, 100.048, 12.0), _trial(200.0, 200.049, 12.5), _trial(300.0, 300.1007, 60.0)]
    report = _way_report(trials)
    assert report["death_to_first_token_ms"]["p50"] == 49.0
    rows = report["per_trial"]
    assert [r["death_to_first_token_ms"] for r in rows] == [48.0, 49.0, 100.7]
    outlier = rows[2]
    assert outlier["timeline_ms"]["endpoint added"] == 60.0  # what the medians (12.5) hide
    assert list(outlier["timeline_ms"]) == ["detected", "endpoint added", "first token after recovery"]
    assert outlier["successor_first_generation"] == {"slot": 14.12}
    assert outlier["successor_continued"] == {"generations": 1, "early": 1}
    assert report["weights_intact"] and report["outputs_match"] and report["requests_lost"] == 0
