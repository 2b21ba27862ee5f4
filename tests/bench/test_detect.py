"""`holdfast bench detect`: real stacks (nats-server, etcd, an agent) whose engines are SIGKILLed; both ways of
seeing a death (death marks beside the poll, the poll alone) measured in one run, with the host described."""

from __future__ import annotations

import pytest

from bench.detect import run


@pytest.mark.timeout(300)
def test_both_ways_see_every_kill_with_its_signal_and_the_report_names_its_machine() -> None:
    report = run(kills=3, ballast_mib=16)
    for way, seen in (("marks", {"death mark", "poll"}), ("poll", {"poll"})):
        r = report[way]
        assert r["kills"] == 3 and r["kinds"] == ["killed"], r
        # each fault names the signal and one of the ways this agent was set to see it, or its pidfd's (the end of
        # the teardown, the status read from the zombie): on a loaded machine that can come before the next poll
        ways = {d.removeprefix("signal SIGKILL (seen exiting: ").removesuffix(")") for d in r["details"]}
        assert ways <= seen | {"signal SIGKILL"}, r
        assert r["publish_ms"]["n"] == 3 and r["publish_ms"]["p50"] > 0
    assert report["machine"]["cpus"] >= 1 and report["ballast_mib"] == 16
