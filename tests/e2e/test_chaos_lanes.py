"""Which chaos faults run at once (bench/chaos_lanes.py): pure logic."""

from __future__ import annotations

import random

import pytest

from bench.chaos_lanes import Claims, resources
from bench.chaos_run import FAULTS

MODELS = ["demo", "demo-2"]


def test_every_fault_kind_holds_something() -> None:
    for fault in FAULTS:
        assert resources(fault, "demo", MODELS), fault


def test_an_unknown_fault_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        resources("engine_sigterm", "demo", MODELS)


def test_engine_faults_on_two_models_overlap_and_on_one_model_do_not() -> None:
    c = Claims()
    a = c.request(resources("engine_sigkill", "demo", MODELS))
    b = c.request(resources("engine_sigstop", "demo-2", MODELS))
    d = c.request(resources("engine_cuda_error", "demo", MODELS))
    assert c.grant() == [a, b]
    c.release(a)
    assert c.grant() == [d]


def test_a_service_restart_overlaps_an_engine_fault_but_not_a_second_restart_of_it() -> None:
    c = Claims()
    a = c.request(resources("engine_sigkill", "demo", MODELS))
    b = c.request(resources("etcd_stall", "demo", MODELS))
    d = c.request(resources("etcd_restart", "demo-2", MODELS))
    assert c.grant() == [a, b]  # the restart waits: SIGCONT must reach the stalled process, not its successor
    c.release(b)
    assert c.grant() == [d]


def test_an_xid_overlaps_engine_faults_but_not_an_agent_kill_or_another_xid() -> None:
    c = Claims()
    a = c.request(resources("engine_sigkill", "demo", MODELS))
    x = c.request(resources("gpu_xid", "demo", MODELS))
    k = c.request(resources("agent_sigkill", "demo", MODELS))  # the XID is read by the agent
    y = c.request(resources("engine_sigkill_allocating", "demo-2", MODELS, via_xid=True))
    assert c.grant() == [a, x]
    c.release(x)
    assert c.grant() == [k]  # first come, first served: the later XID waits behind the agent kill
    c.release(k)
    assert c.grant() == [y]


def test_a_request_is_not_overtaken_by_a_later_one_wanting_the_same() -> None:
    c = Claims()
    a = c.request(resources("engine_sigkill", "demo", MODELS))
    assert c.grant() == [a]
    f = c.request(resources("gpu_manager_fd_pressure", "demo", MODELS))  # waits for model demo
    g = c.request(resources("gpu_manager_sigkill", "demo", MODELS))  # the gpu_manager is f's: waits behind it
    assert c.grant() == []
    c.release(a)
    assert c.grant() == [f]
    c.release(f)
    assert c.grant() == [g]


def test_random_requests_never_hold_one_resource_twice() -> None:
    rng = random.Random(3)
    c = Claims()
    for _ in range(2000):
        if c.held and rng.random() < 0.5:
            c.release(rng.choice(list(c.held)))
        else:
            c.request(resources(rng.choice(FAULTS), rng.choice(MODELS), MODELS, via_xid=rng.random() < 0.5))
        c.grant()
        held = [r for want in c.held.values() for r in want]
        assert len(held) == len(set(held))
