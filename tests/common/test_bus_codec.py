"""The codec's per-class reads (pure): which records an event carries, read once per class, answer per event."""

from __future__ import annotations

from libs.common import events as ev
from libs.common.bus import codec


def _engine(node: str) -> ev.EngineInfo:
    return ev.EngineInfo(engine_id="e-1", node=node, model="m", engine_class="c", role=ev.EngineRole.ACTIVE)


def _lease(node: str) -> ev.LeaseInfo:
    return ev.LeaseInfo(id="l-1", node=node, gpu=0, size=1, chunk_size=1, tag=ev.Tag.WEIGHTS, owner="e-1", epoch=1,
                        state=ev.LeaseState.ACTIVE, created_at=0.0, last_seen=0.0)


def test_the_nodes_an_event_carries_are_those_of_its_own_records_whichever_class_came_first() -> None:
    fault = ev.FaultDetected(engine_id="e-1", node="n1", kind=ev.FaultKind.KILLED)
    # Alternating classes and values: the per-class table holds which fields a class has, never a value.
    for node in ("n1", "n2"):
        assert codec.carried_nodes(fault) == []
        assert codec.carried_nodes(ev.EngineReady(engine=_engine(node))) == [node]
        assert codec.carried_nodes(ev.LeaseChanged(lease=_lease(node), from_state=None)) == [node]
        assert codec.carried_nodes(fault) == []
