"""Percentiles of a bench's samples: one rule for every bench (pure).

Quantiles are `statistics.quantiles(..., method="inclusive")` (linear interpolation between the closest ranks, so
p50 is the median); one sample is every quantile of itself; no sample gives None for each figure but `n`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

KEYS = ("p50", "p99", "max")


def quantile(values: Sequence[float], q: int) -> float:
    """The q-th percentile (1..99) of at least one value."""
    if not 1 <= q <= 99:
        raise ValueError(f"percentile {q}: 1..99")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def pct(values: Sequence[float], *, digits: int = 3, keys: Sequence[str] = KEYS) -> dict[str, float | int | None]:
    """The figures `keys` of `values`, in that order: `n`, `min`, `max`, `mean` or `pNN` (a percentile)."""
    out: dict[str, float | int | None] = {}
    for k in keys:
        if k == "n":
            out[k] = len(values)
        elif not values:
            out[k] = None
        elif k in ("min", "max"):
            out[k] = round(min(values) if k == "min" else max(values), digits)
        elif k == "mean":
            out[k] = round(statistics.fmean(values), digits)
        elif k.startswith("p") and k[1:].isdigit():
            out[k] = round(quantile(values, int(k[1:])), digits)
        else:
            raise ValueError(f"unknown figure {k!r}: n, min, max, mean or pNN")
    return out
