"""bench/stats.py: the one percentile rule of the benches (pure)."""

from __future__ import annotations

import statistics

import pytest

from bench.stats import pct, quantile


def test_percentiles_interpolate_and_p50_is_the_median():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    assert quantile(xs, 50) == statistics.median(xs)
    assert pct(xs) == {"p50": 3.5, "p99": 9.75, "max": 10.0}
    assert pct(xs, digits=1, keys=("n", "min", "mean", "p90")) == {"n": 6, "min": 1.0, "mean": 4.2, "p90": 7.5}


def test_one_sample_is_every_percentile_and_none_gives_none():
    assert pct([0.12345], digits=2) == {"p50": 0.12, "p99": 0.12, "max": 0.12}
    assert pct([], keys=("n", "p50", "max")) == {"n": 0, "p50": None, "max": None}


@pytest.mark.parametrize("keys", [("p0",), ("p100",), ("median",)])
def test_an_unknown_figure_is_refused(keys: tuple[str, ...]):
    with pytest.raises(ValueError):
        pct([1.0, 2.0], keys=keys)
