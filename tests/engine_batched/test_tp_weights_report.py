"""A tensor-parallel group's cold load as one report (pure): rank 0 sums up each rank's source for the agent, the
agent keeps the ranks, and the incident's timeline line says which copy served every rank."""

from __future__ import annotations

import pytest

from engines.batched.tp_group import group_weights_load
from libs.common.errors import MalformedMessage
from services.agent.engines import weights_loaded


def report(source: str, ms: float, refused: str = "") -> dict:
    return {"source": source, "load_ms": ms, **({"refused": refused} if refused else {})}


def test_ranks_restored_alike_read_as_one_source_over_the_ranks() -> None:
    got = group_weights_load([report("host", 4.0), report("host", 6.5)])
    rec = weights_loaded(got)
    assert rec is not None and rec.ranks == ["host", "host"]
    assert rec.describe() == "weights from host (2 ranks) in 6.5 ms"  # the ranks load at once: the longest


def test_a_rank_that_read_the_file_makes_the_group_a_file_load_and_says_which_and_why() -> None:
    got = group_weights_load([report("host", 4.0), report("file", 90.0, "artifact_invalid: block 0")])
    assert got is not None and got["source"] == "file" and got["refused"] == "rank 1: artifact_invalid: block 0"
    rec = weights_loaded(got)
    assert rec is not None and rec.describe() == ("weights from host (rank 0), file (rank 1) in 90.0 ms "
                                                  "(copy refused: rank 1: artifact_invalid: block 0)")


def test_a_group_that_took_its_leases_over_reports_no_cold_load() -> None:
    assert group_weights_load([None, None]) is None and group_weights_load([report("host", 1.0), None]) is None


def test_a_rank_source_the_agent_does_not_know_is_refused_as_malformed() -> None:
    with pytest.raises(MalformedMessage):
        weights_loaded({"source": "host", "load_ms": 1.0, "ranks": ["host", "nvme"]})  # no such source
