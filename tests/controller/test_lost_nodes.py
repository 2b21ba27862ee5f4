"""lost_nodes.py's invariants, pure: which engines of a gone node are suspects, when, and once."""

from __future__ import annotations

from libs.common.events import EngineInfo, EngineRole, FaultKind
from services.controller.lost_nodes import LostNodes, lost_fault


def engine(eid: str, node: str = "n2", role: EngineRole = EngineRole.ACTIVE, state: str = "ready",
           generation: int = 0) -> EngineInfo:
    return EngineInfo(engine_id=eid, node=node, model="m", engine_class="c", role=role, state=state,
                      generation=generation, endpoint=f"http://127.0.0.1:1/{eid}")


def test_only_active_engines_of_a_node_gone_after_s_are_suspects_once_until_after_s_again() -> None:
    lost = LostNodes(after_s=5.0)
    engines = [engine("a"), engine("sb", role=EngineRole.STANDBY, state="standby"), engine("x", state="failed"),
               engine("b", node="n1")]
    never = lambda e: False  # noqa: E731
    assert lost.suspects(100.0, ["n1"], engines, never) == []  # n2 first seen missing now
    assert lost.suspects(104.9, ["n1"], engines, never) == []
    assert [e.engine_id for e in lost.suspects(105.0, ["n1"], engines, never)] == ["a"]
    assert lost.suspects(106.0, ["n1"], engines, never) == []  # asked already: its probe runs
    assert not lost.answered(engines[0], alive=True)  # it answered: a suspect again only after_s later
    assert lost.suspects(109.9, ["n1"], engines, never) == []
    assert [e.engine_id for e in lost.suspects(110.0, ["n1"], engines, never)] == ["a"]
    assert lost.answered(engines[0], alive=False)  # declared, once
    assert not lost.answered(engines[0], alive=False)
    assert lost.suspects(200.0, ["n1"], engines, never) == []


def test_a_node_back_starts_its_count_again_and_a_handled_generation_is_no_suspect() -> None:
    lost = LostNodes(after_s=5.0)
    a = engine("a")
    assert lost.suspects(0.0, [], [a], lambda e: False) == []
    assert lost.suspects(3.0, ["n2"], [a], lambda e: False) == []  # back: forgotten
    assert lost.suspects(6.0, [], [a], lambda e: False) == []  # gone again since 6
    assert lost.suspects(11.0, [], [a], lambda e: True) == []  # an incident took its generation up
    assert [e.engine_id for e in lost.suspects(11.0, [], [a, engine("a2", generation=1)], lambda e: e.engine_id == "a")] \
        == ["a2"]
    assert LostNodes(after_s=0).suspects(1e9, [], [a], lambda e: False) == []  # off


def test_the_fault_is_the_one_its_agent_would_send_and_loses_memory() -> None:
    env = lost_fault(engine("a", generation=3), 12.5, "ctl-1")
    f = env.data
    assert env.node == "n2" and env.source == "ctl-1" and env.type == "fault.detected"
    assert f.kind is FaultKind.NODE_LOST and f.kind.loses_memory and f.generation == 3 and f.node == "n2"
    assert "gone for 12.5 s" in f.detail


def test_an_engine_with_no_endpoint_is_left_to_its_node_and_a_replaced_one_is_marked_once() -> None:
    lost = LostNodes(after_s=1.0)
    starting = engine("s", state="starting").model_copy(update={"endpoint": None})
    a = engine("a")
    assert lost.suspects(0.0, [], [starting, a], lambda e: False) == []
    assert [e.engine_id for e in lost.suspects(1.0, [], [starting, a], lambda e: False)] == ["a"]
    replaced = lambda e: e.engine_id == "a"  # noqa: E731
    assert [e.engine_id for e in lost.ghosts(["n1"], [starting, a], replaced)] == ["a"]
    assert lost.ghosts(["n1"], [starting, a], replaced) == []  # once
    assert lost.ghosts(["n2"], [engine("b")], lambda e: True) == []  # its node is there: its agent's


def test_an_engine_declared_lost_and_replaced_is_stopped_once_when_its_node_is_back() -> None:
    lost = LostNodes(after_s=1.0)
    a = engine("a")
    lost.suspects(0.0, [], [a], lambda e: False)
    [suspect] = lost.suspects(1.0, [], [a], lambda e: False)
    assert lost.answered(suspect, alive=False)
    replaced = lambda e: True  # noqa: E731
    records = {"a": a, "b": engine("b")}
    assert lost.returned([], records.get, replaced) == []  # its node still gone
    assert lost.returned(["n2"], records.get, lambda e: False) == []  # back, not replaced (its incident failed): it serves
    assert lost.returned(["n2"], {"a": engine("a", generation=1)}.get, replaced) == []  # a later generation's record
    assert [e.engine_id for e in lost.returned(["n2"], records.get, replaced)] == ["a"]
    assert lost.returned(["n2"], records.get, replaced) == []  # once; b never declared lost here: its agent's
