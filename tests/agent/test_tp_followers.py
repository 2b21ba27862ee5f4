"""A tensor-parallel group's follower watched by the agent itself: a real agent, a real TP=2 reference engine (tiny,
gloo on the CPU, local memory: no gpu_manager), real signals. Rank 0 names its follower as it registers; the
follower's SIGKILL is the group's one fault, seen by the agent's own watch of the follower (its /proc exit poll or its
pidfd, whichever first; the detail names rank 1 and its pid, never rank 0's exit 70), and the group is replaced. A
restarted agent watches the follower again from the group's record; with the exit poll off there, the fault comes
from the follower's pidfd."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from devstack.scenario import engine_command
from libs.common.events import EngineInfo, EngineRole, EngineSpec, FaultKind, RankProcess
from libs.common.store import Store
from services.agent.pidfd import proc_start_time, proc_state
from tests.agent.conftest import TWO_GPUS, AgentProcess, Recorder, engine_records
from tests.engine.support import make_tiny_weights
from tests.support import wait_until

MODEL = "tp-tiny"
# Two torch processes starting on a loaded 2-core machine: a group's start-up and its heartbeats are not what is tested.
PATIENT = {"gpus": TWO_GPUS, "heartbeat_timeout_s": 5.0, "start_heartbeat_timeout_s": 60.0, "takeover_wait_s": 0.5}


def tp_spec(weights: Path) -> EngineSpec:
    return EngineSpec(engine_class="reference", model=MODEL, command=engine_command(weights, "tiny"), tp=2,
                      replicas=1, standbys=0, gpus=[0], cold_start_s=60.0,
                      env={"HF_ENGINE_MEMORY": "local"})


def ended(pid: int | None) -> bool:
    """Gone or a zombie (an adopted rank 0's reaper is not the agent)."""
    return pid is not None and proc_state(pid) in (None, "Z", "X")


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


async def serving_group(recorder: Recorder, store: Store, skip: set[str] = frozenset()) -> tuple[EngineInfo, int]:
    """The group once ready, and its follower's pid (rank 0's one child), as its record names it."""
    ready = await recorder.wait("engine.ready", lambda e: e.engine.role is EngineRole.ACTIVE
                                and e.engine.engine_id not in skip, within_s=150)
    group = ready.engine
    assert group.tp == 2 and group.pid is not None
    [rank1] = children(group.pid)
    assert group.followers == [RankProcess(rank=1, pid=rank1, pid_start=proc_start_time(rank1))]

    async def recorded() -> bool:
        rec = (await engine_records(store)).get(group.engine_id)
        return rec is not None and rec.state == "ready" and rec.followers == group.followers

    await wait_until(recorded)  # in etcd too: what a restarted agent reads
    return group, rank1


def assert_the_followers_fault(fault: object, group: EngineInfo, rank1: int) -> None:
    f = fault
    assert f.kind is FaultKind.KILLED and f.group == group.engine_id and f.pid == group.pid  # type: ignore[attr-defined]
    # named by the follower's own watch: its rank, engine id and pid; not rank 0's exit 70 (then "exit code 70")
    assert f"rank 1 ({group.engine_id}-r1, pid {rank1}) of the group died" in f.detail, f.detail  # type: ignore[attr-defined]
    assert f.exit_code is None and "exit code 70" not in f.detail  # type: ignore[attr-defined]
    assert f.rank == 1  # type: ignore[attr-defined]  # the rank itself, not only in the detail


async def test_a_followers_sigkill_is_the_groups_one_fault_seen_by_the_agents_own_watch_and_the_group_is_replaced(
        agent: AgentProcess, recorder: Recorder, store: Store, tmp_path: Path) -> None:
    spec = tp_spec(make_tiny_weights(tmp_path / "tiny.safetensors"))
    agent.start([spec], **PATIENT)
    group, rank1 = await serving_group(recorder, store)

    os.kill(rank1, signal.SIGKILL)
    fault = await recorder.wait("fault.detected", lambda f: f.engine_id == group.engine_id)
    assert_the_followers_fault(fault, group, rank1)
    assert fault.detail.endswith(("(its pidfd)", "(seen exiting)"))
    # rank 0 ends (its own exit 70 here: no takeover comes without a controller) and a new group replaces it
    await wait_until(lambda: ended(group.pid), within_s=30)
    successor, _ = await serving_group(recorder, store, skip={group.engine_id})
    assert successor.engine_id != group.engine_id and successor.gpu == group.gpu
    await asyncio.sleep(0.5)
    assert len(recorder.of("fault.detected", lambda f: f.engine_id == group.engine_id)) == 1  # rank 0's exit added none
    assert recorder.of("fault.detected", lambda f: f.engine_id == successor.engine_id) == []


async def test_a_restarted_agent_watches_a_groups_follower_again_through_its_pidfd(
        agent: AgentProcess, recorder: Recorder, store: Store, tmp_path: Path) -> None:
    spec = tp_spec(make_tiny_weights(tmp_path / "tiny.safetensors"))
    agent.start([spec], **PATIENT)
    group, rank1 = await serving_group(recorder, store)
    agent.kill(signal.SIGKILL)

    agent.start([spec], **PATIENT, exit_poll_ms=600_000)  # no /proc exit poll in the test's time: the pidfd alone
    await agent.wait_up(store)  # re-adopted (rank 0 and its follower watched) before the node key is written
    os.kill(rank1, signal.SIGKILL)
    fault = await recorder.wait("fault.detected", lambda f: f.engine_id == group.engine_id)
    assert_the_followers_fault(fault, group, rank1)
    # the status its zombie held as the pidfd turned readable (rank 0 reaps it within 50 ms), or unknown past that
    assert fault.detail.endswith(("signal SIGKILL (its pidfd)", "(its pidfd; not the agent's child: its status unknown)"))
    await wait_until(lambda: ended(group.pid), within_s=30)
    await asyncio.sleep(0.5)
    assert len(recorder.of("fault.detected", lambda f: f.engine_id == group.engine_id)) == 1


async def test_a_group_adopted_as_a_stranger_is_recorded_as_a_group_and_its_follower_watched(
        agent: AgentProcess, recorder: Recorder, store: Store, tmp_path: Path) -> None:
    """An agent that finds a group it has no record of (its predecessor's record lost, no spec of its own for it)
    adopts rank 0 as a stranger: the group's size comes from the followers rank 0 names, so the record is a group's
    and the follower's death is the group's fault, as for a group the agent started."""
    spec = tp_spec(make_tiny_weights(tmp_path / "tiny.safetensors"))
    agent.start([spec], **PATIENT)
    group, rank1 = await serving_group(recorder, store)
    agent.kill(signal.SIGKILL)
    assert await store.delete_prefix("engines/") >= 1  # what a restarted agent would read of it: gone
    assert await store.delete_prefix("agents/node-1/specs/") == 1  # and no spec: else it may start one of its own

    agent.start([], **PATIENT, exit_poll_ms=600_000)  # no spec: nothing started in its place; the pidfd alone

    async def adopted() -> bool:
        rec = (await engine_records(store)).get(group.engine_id)
        return rec is not None and rec.tp == 2 and rec.followers == group.followers

    await wait_until(adopted, within_s=60)  # rank 0's link registered again, with its follower
    os.kill(rank1, signal.SIGKILL)
    fault = await recorder.wait("fault.detected", lambda f: f.engine_id == group.engine_id)
    assert_the_followers_fault(fault, group, rank1)
    await wait_until(lambda: ended(group.pid), within_s=30)
