"""Pure logic of the agent: the engine lifecycle table, the fault latch, the supervision plan, standby choice."""

from __future__ import annotations

import pytest

from libs.common.errors import InvalidTransition
from libs.common.events import EngineRole, EngineSpec, FaultKind
from services.agent.engines import EngineRecord, Ev, State
from services.agent.supervision import (
    admit_stranger,
    assignment_refused,
    inherit_assignment,
    never_linked,
    overdue,
    pick_standby,
    plan,
    registered,
    shadow_plan,
    spec_key,
    stranger_key,
)
from services.agent.takeover import why_not_promoted

SPEC = EngineSpec(model="m", command=["x"], replicas=2, standbys=1, cold_start_s=5)
KEY = spec_key(SPEC)


def rec(eid: str, role: EngineRole = EngineRole.ACTIVE, state: State = State.READY, **kw: object) -> EngineRecord:
    return EngineRecord(engine_id=eid, model="m", engine_class="reference", role=role, state=state, spec_key=KEY,
                        **kw)  # type: ignore[arg-type]


def test_a_standby_becomes_standby_not_ready_when_it_says_ready() -> None:
    r = rec("s", EngineRole.STANDBY, State.STARTING)
    assert r.transition(Ev.READY) is State.STANDBY
    assert r.transition(Ev.ASSIGN) is State.ASSIGNED
    assert r.transition(Ev.READY) is State.READY


def test_an_undefined_move_raises_invalid_transition() -> None:
    r = rec("a", state=State.STOPPED)
    with pytest.raises(InvalidTransition):
        r.transition(Ev.READY)


def test_the_fault_latch_lets_one_fault_through_per_generation_and_none_while_stopping() -> None:
    r = rec("a")
    assert r.latch_fault() and not r.latch_fault()
    stopping = rec("b", state=State.STOPPING)
    assert not stopping.latch_fault()


def test_the_plan_tops_up_replicas_and_standbys() -> None:
    p = plan({KEY: SPEC}, [rec("a")], now=100.0, takeover_wait_s=10)
    assert sorted(p.start) == sorted([(KEY, EngineRole.ACTIVE), (KEY, EngineRole.STANDBY)])
    assert p.retire == []


def test_a_failed_active_engine_keeps_its_slot_until_the_takeover_wait_passes() -> None:
    failed = rec("a", state=State.FAILED, failed_mono=95.0)
    records = [failed, rec("b"), rec("s", EngineRole.STANDBY, State.STANDBY)]
    assert plan({KEY: SPEC}, records, now=100.0, takeover_wait_s=10).start == []
    later = plan({KEY: SPEC}, records, now=106.0, takeover_wait_s=10)
    assert later.retire == ["a"] and later.start == [(KEY, EngineRole.ACTIVE)]


def test_a_failed_standby_is_retired_at_once() -> None:
    p = plan({KEY: SPEC}, [rec("a"), rec("b"), rec("s", EngineRole.STANDBY, State.FAILED, failed_mono=99.0)],
             now=100.0, takeover_wait_s=10)
    assert p.retire == ["s"] and p.start == [(KEY, EngineRole.STANDBY)]


def test_a_standby_is_picked_only_on_the_predecessors_gpu() -> None:
    """The leases' memory is the predecessor's GPU's: a standby on another GPU is never given them (a cold
    successor on that GPU reattaches them instead)."""
    on_1 = rec("on-1", EngineRole.STANDBY, State.STANDBY, spawned_mono=1.0, gpu=1)
    on_0 = rec("on-0", EngineRole.STANDBY, State.STANDBY, spawned_mono=2.0, gpu=0)
    assert pick_standby([on_1, on_0], "m", gpu=0) is on_0  # not the older one on GPU 1
    assert pick_standby([on_1], "m", gpu=0) is None
    assert pick_standby([on_1], "m", gpu=0, named="on-1") is None
    assert pick_standby([on_1, on_0], "m") is on_1  # GPU unknown: the oldest


def test_the_oldest_ready_standby_of_the_model_and_version_is_picked() -> None:
    young = rec("young", EngineRole.STANDBY, State.STANDBY, spawned_mono=5.0)
    old = rec("old", EngineRole.STANDBY, State.STANDBY, spawned_mono=1.0)
    warming = rec("warming", EngineRole.STANDBY, State.STARTING, spawned_mono=0.0)
    other = rec("v2", EngineRole.STANDBY, State.STANDBY, spawned_mono=0.5, version="2")
    records = [young, old, warming, other]
    assert pick_standby(records, "m", version="1").engine_id == "old"  # type: ignore[union-attr]
    assert pick_standby(records, "m", version="2").engine_id == "v2"  # type: ignore[union-attr]
    assert pick_standby(records, "m", named="young").engine_id == "young"  # type: ignore[union-attr]
    assert pick_standby(records, "m", named="warming") is None
    assert pick_standby(records, "other-model") is None


def test_only_armed_live_unfaulted_engines_can_be_overdue() -> None:
    late = rec("late", last_heartbeat=10.0)
    fresh = rec("fresh", last_heartbeat=10.8)
    unarmed = rec("unarmed")
    faulted = rec("faulted", last_heartbeat=1.0, faulted=True)
    assert [r.engine_id for r in overdue([late, fresh, unarmed, faulted], 11.5, 1.0)] == ["late"]


def test_an_engine_whose_link_is_not_up_again_gets_the_start_timeout() -> None:
    """Re-adopted by a restarted agent, an engine beats again only once its link has registered again."""
    readopted = rec("readopted", last_heartbeat=10.0)  # linked False: its link not (yet) reconnected
    linked = rec("linked", last_heartbeat=10.0, linked=True)
    assert [r.engine_id for r in overdue([readopted, linked], 12.0, 1.0, 10.0)] == ["linked"]
    assert [r.engine_id for r in overdue([readopted, linked], 20.5, 1.0, 10.0)] == ["readopted", "linked"]


def test_a_registration_restarts_the_heartbeat_deadline_of_a_readopted_engine() -> None:
    """Re-adopted at 10.0 (its deadline armed then), its link registering at 10.9: silent for the timeout from the
    registration, not from the re-adoption (the agent reads its heartbeats only from then on)."""
    readopted = rec("readopted", last_heartbeat=10.0)
    registered(readopted, True, 10.9)
    assert readopted.linked
    assert overdue([readopted], 11.5, 1.0, 10.0) == []
    assert overdue([readopted], 12.0, 1.0, 10.0) == [readopted]
    quiet = rec("quiet")  # an engine that sends no heartbeats: registering arms nothing
    registered(quiet, False, 10.9)
    assert quiet.linked and quiet.last_heartbeat is None


def test_an_engine_that_never_connects_within_twice_its_cold_start_is_flagged() -> None:
    slow = rec("slow", state=State.STARTING, spawned_mono=0.0)
    assert never_linked([slow], 9.0, {KEY: SPEC}) == []
    assert never_linked([slow], 11.0, {KEY: SPEC}) == [slow]


def test_an_agents_own_absence_is_not_an_engines_silence() -> None:
    from services.agent.supervision import credit_absence

    quiet = rec("quiet", last_heartbeat=10.0)  # last heard at 10.0; the agent then stopped until 22.0
    recent = rec("recent", last_heartbeat=21.9)
    unarmed = rec("unarmed")
    credit_absence([quiet, recent, unarmed], 11.9, 22.0)
    assert overdue([quiet, recent, unarmed], 22.0, 1.0) == []
    assert quiet.last_heartbeat == 21.9 and recent.last_heartbeat == 22.0 and unarmed.last_heartbeat is None
    assert [r.engine_id for r in overdue([quiet, recent], 23.0, 1.0)] == ["quiet"]  # silent while listened to


def test_probes_count_failures_in_a_row_and_forget_engines_no_longer_probed() -> None:
    from services.agent.supervision import count_probes

    failures: dict[str, int] = {}
    assert count_probes(failures, {"a": False, "b": False}, 2) == []
    assert count_probes(failures, {"a": False, "b": True}, 2) == ["a"]  # b answered: its count starts over
    assert count_probes(failures, {"a": False, "b": False}, 2) == []  # a is reported once, at the limit
    assert count_probes(failures, {"b": False}, 2) == ["b"] and "a" not in failures


def test_a_probe_round_counts_for_nobody_when_the_agent_itself_was_away() -> None:
    from services.agent.supervision import probe_round_void

    assert not probe_round_void(5.0, 5.0, 5.0, 5.0)  # on time, every probe timing out: counts
    assert not probe_round_void(6.0, 6.0, 5.0, 5.0)  # 2 s late in all: under half of 5 s
    assert probe_round_void(8.0, 1.0, 5.0, 5.0)  # its sleep 3 s late
    assert probe_round_void(5.0, 8.0, 5.0, 5.0)  # its probes 3 s past their timeout
    assert probe_round_void(5.5, 0.0, 5.0, 0.5)  # the shorter of the two sets the bar: 0.5 s late > 0.25 s


def test_a_strangers_group_size_is_its_specs_else_its_named_followers_and_itself() -> None:
    from services.agent.supervision import stranger_tp

    assert stranger_tp(SPEC.model_copy(update={"tp": 4}), [{"rank": 1}]) == 4
    assert stranger_tp(None, [{"rank": 1}, {"rank": 2}]) == 3
    assert stranger_tp(None, []) == 1 and stranger_tp(None, None) == 1 and stranger_tp(None, "junk") == 1


def test_a_stranger_is_matched_to_its_spec_by_model_class_and_version_or_to_none() -> None:
    assert stranger_key({KEY: SPEC}, SPEC.model, SPEC.engine_class, SPEC.version) == KEY
    assert stranger_key({KEY: SPEC}, SPEC.model, SPEC.engine_class, "2") is None  # another version: not this spec
    assert stranger_key({KEY: SPEC}, "other", SPEC.engine_class, SPEC.version) is None


def test_a_stranger_is_admitted_only_while_its_spec_has_room_for_its_role() -> None:
    specs = {KEY: SPEC}  # 2 active, 1 standby
    one = [rec("a", state=State.STARTING)]
    assert admit_stranger(specs, one, KEY, EngineRole.ACTIVE) is None
    full = [rec("a", state=State.STARTING), rec("b")]
    why = admit_stranger(specs, full, KEY, EngineRole.ACTIVE)
    assert why is not None and "wants 2 active" in why
    # a failed or stopping engine runs no more: its slot is not a stranger's to be refused for
    assert admit_stranger(specs, [rec("a"), rec("b", state=State.FAILED, failed_mono=1.0)], KEY,
                          EngineRole.ACTIVE) is None
    assert admit_stranger(specs, full, KEY, EngineRole.STANDBY) is None
    why = admit_stranger(specs, [*full, rec("s", EngineRole.STANDBY, State.STANDBY)], KEY, EngineRole.STANDBY)
    assert why is not None and "standby" in why
    assert admit_stranger(specs, full, None, EngineRole.ACTIVE) is None  # nobody configured it: no count to keep


def test_an_adopted_stranger_counts_for_its_spec_so_nothing_more_starts() -> None:
    # The reverse order: the stranger registered before the reconciler's pass; adopted with its spec key, it
    # fills the slot the plan would otherwise have started an engine for.
    spec = SPEC.model_copy(update={"replicas": 1, "standbys": 0})
    adopted = rec("stranger", state=State.STARTING)
    assert adopted.spec_key == KEY
    assert plan({KEY: spec}, [adopted], now=100.0, takeover_wait_s=10).start == []
    assert admit_stranger({KEY: spec}, [adopted], KEY, EngineRole.ACTIVE) is not None


def test_nothing_starts_while_strangers_may_still_register_then_the_missing_ones_do() -> None:
    spec = SPEC.model_copy(update={"replicas": 2, "standbys": 1})
    waiting = plan({KEY: spec}, [rec("a")], now=100.0, takeover_wait_s=10, starts_from=100.5)
    assert waiting.start == [] and waiting.held == [KEY]
    later = plan({KEY: spec}, [rec("a")], now=100.5, takeover_wait_s=10, starts_from=100.5)
    assert later.start == [(KEY, EngineRole.ACTIVE), (KEY, EngineRole.STANDBY)] and later.held == []
    assert plan({KEY: SPEC.model_copy(update={"replicas": 1, "standbys": 0})}, [rec("a")], now=100.0,
                takeover_wait_s=10, starts_from=100.5).held == []  # nothing missing: nothing held


def test_a_sleeping_engine_is_not_shadowed_and_its_shadows_are_dropped_until_it_wakes() -> None:
    """A shadow's mapping would keep a sleeping engine's memory alive (docs/restore.md)."""
    active = rec("a")
    standby = rec("s", EngineRole.STANDBY, State.STANDBY, can_shadow=True, linked=True)
    idle = rec("t", EngineRole.STANDBY, State.STANDBY, can_shadow=True, linked=True)
    assert [(sb.engine_id, t.engine_id) for sb, t in shadow_plan([active, standby, idle]).offer] == [("s", "a"),
                                                                                                    ("t", "a")]
    standby.shadows = "a"
    active.asleep = True
    sleeping = shadow_plan([active, standby, idle])
    assert sleeping.drop == [standby] and sleeping.offer == []  # dropped, and nobody offered the sleeper
    standby.shadows, active.asleep = None, False
    assert [sb.engine_id for sb, _ in shadow_plan([active, standby, idle]).offer] == ["s", "t"]  # awake: again


def test_the_agent_promotes_only_a_dead_active_engines_shadowing_self_fencing_standby() -> None:
    """takeover.py `why_not_promoted`: a process's own death (killed, exited) of an active single engine on a sound
    GPU, with a ready standby that shadows it and fences itself; anything else is left to the control plane."""
    dead = rec("a", state=State.FAILED)
    sb = rec("s", EngineRole.STANDBY, State.STANDBY, shadows="a", fences=True)
    assert why_not_promoted(dead, FaultKind.KILLED, sb, gpu_sound=True) is None
    assert why_not_promoted(dead, FaultKind.EXITED, sb, gpu_sound=True) is None
    for kind in (FaultKind.HUNG, FaultKind.CUDA_ERROR, FaultKind.GPU_FAULT):  # alive, or its memory in doubt
        assert why_not_promoted(dead, kind, sb, gpu_sound=True) == f"a {kind.value} fault"
    assert why_not_promoted(dead, FaultKind.KILLED, sb, gpu_sound=False) == "its GPU 0 is not sound"
    assert why_not_promoted(rec("a", EngineRole.STANDBY, State.FAILED), FaultKind.KILLED, sb,
                            gpu_sound=True) == "not an active single engine"
    assert why_not_promoted(rec("a", state=State.FAILED, tp=2), FaultKind.KILLED, sb,
                            gpu_sound=True) == "not an active single engine"
    assert why_not_promoted(rec("a", state=State.FAILED, handing_over=True), FaultKind.KILLED, sb,
                            gpu_sound=True) == "a takeover of it is under way"
    no = "no ready standby shadows it and fences itself"
    assert why_not_promoted(dead, FaultKind.KILLED, None, gpu_sound=True) == no
    for other in (rec("s", EngineRole.STANDBY, State.STANDBY, shadows="b", fences=True),
                  rec("s", EngineRole.STANDBY, State.STANDBY, shadows="a", fences=False),
                  rec("s", EngineRole.STANDBY, State.STARTING, shadows="a", fences=True)):
        assert why_not_promoted(dead, FaultKind.KILLED, other, gpu_sound=True) == no


def test_a_standby_that_registers_assigned_after_a_restart_is_recorded_as_the_successor_it_is() -> None:
    """Its record (re-adopted from etcd) still says standby; what its registration says wins (probe D2-frozen)."""
    ready = rec("s", EngineRole.STANDBY, State.STANDBY, shadows="a")
    assert inherit_assignment(ready, "inc-a-g0", "a", "ready")
    assert (ready.role, ready.state, ready.assigned_for, ready.taking_over, ready.shadows) == (
        EngineRole.ACTIVE, State.READY, "inc-a-g0", "a", None)
    assert not inherit_assignment(ready, "inc-a-g0", "a", "ready")  # said again: nothing more to learn
    loading = rec("t", EngineRole.STANDBY, State.STANDBY, shadows="a")
    assert inherit_assignment(loading, "inc-a-g0", "a", "assigned")
    assert (loading.role, loading.state, loading.shadows) == (EngineRole.ACTIVE, State.ASSIGNED, "a")  # ready later
    # a spare (the spawn command's assignment, not a takeover's) and a failed standby are left as they are
    spare = rec("p", EngineRole.STANDBY, State.STANDBY, spare=True)
    failed = rec("f", EngineRole.STANDBY, State.FAILED)
    assert not inherit_assignment(spare, "inc-a-g0", "a", "ready") and spare.state is State.STANDBY
    assert not inherit_assignment(failed, "inc-a-g0", "a", "ready") and failed.role is EngineRole.STANDBY


def test_a_claimed_assignment_is_taken_up_only_where_the_claim_cannot_be_a_lie() -> None:
    """A standby's word is all a restarted agent has of an assignment its previous life sent; a claim naming a running
    engine would have it killed with no fault, one naming another model's engine would serve it under that model."""
    standby = rec("s", EngineRole.STANDBY, State.STANDBY, shadows="a")
    dead = rec("a", state=State.FAILED)
    assert assignment_refused(standby, dead, "inc-a-g0", first_here=True) is None
    assert assignment_refused(standby, dead, "mf-a-g0", first_here=True) is None
    assert "first registration" in (assignment_refused(standby, dead, "inc-a-g0", first_here=False) or "")
    assert "not an engine" in (assignment_refused(standby, None, "inc-a-g0", first_here=True) or "")
    assert "is running" in (assignment_refused(standby, rec("a"), "inc-a-g0", first_here=True) or "")
    other = EngineRecord(engine_id="a", model="other", engine_class="reference", role=EngineRole.ACTIVE,
                         state=State.FAILED, spec_key="x")
    assert "serves other" in (assignment_refused(standby, other, "inc-a-g0", first_here=True) or "")
    assert "shadowed a" in (assignment_refused(standby, rec("b", state=State.FAILED), "inc-b-g0", first_here=True)
                            or "")
    assert "not one of a" in (assignment_refused(standby, dead, "inc-zz-g0", first_here=True) or "")
