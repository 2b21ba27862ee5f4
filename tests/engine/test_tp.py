"""The reference engine tensor-parallel (`--tp 2`, gloo on the CPU, the host backend with two simulated GPUs): greedy
output equal to one rank's through the HTTP API; the ranks' leases one gang, frozen and taken over by a new group
that serves the same output without the weights file; a partial or stale group refused with nothing moved; the
group dies whole."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import FreezeGang, FreezeGangReply, LeaseState, ListLeases, ListLeasesReply
from tests.engine.conftest import end_processes_of, start_gpu_manager
from tests.engine.support import EngineProc, generate

PROMPT = {"prompt": "Ranks hold shards.", "max_tokens": 40, "ignore_eos": True}


@pytest.fixture
def two_gpus(settings: CommonSettings, settings_env: dict[str, str], tmp_path: Path) -> Iterator[Path]:
    """A real gpu_manager (host backend) with simulated GPUs 0 and 1: rank r leases on GPU r."""
    child = start_gpu_manager(settings, {**settings_env, "HF_GPUS": json.dumps(["0", "1"])}, tmp_path)
    yield settings.state_dir / "gpu_manager.sock"
    child.stop()
    end_processes_of(settings.state_dir)


def engine(tmp: Path, weights: Path, engine_id: str, env: dict[str, str], *args: str, **extra: str) -> EngineProc:
    return EngineProc(tmp, weights, engine_id, env={**env, **extra}, args=args).start()


def kill_group(e: EngineProc) -> None:
    """SIGKILL rank 0 only: its followers die with it (PR_SET_PDEATHSIG)."""
    e.child.kill(signal.SIGKILL)
    e.child.proc.wait(10)  # type: ignore[union-attr]


def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
              for p in pids if Path(f"/proc/{p}/stat").exists()):
        assert time.monotonic() < deadline, f"ranks {pids} outlived their group"
        time.sleep(0.05)


def follower_pids(rank0: int) -> list[int]:
    children = Path(f"/proc/{rank0}/task/{rank0}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def test_two_ranks_serve_the_same_greedy_output_as_one_through_http(tmp_path: Path, tiny_weights: Path,
                                                                    settings_env: dict[str, str]) -> None:
    one = engine(tmp_path, tiny_weights, "tp-one", settings_env, "--memory", "local")
    two = engine(tmp_path, tiny_weights, "tp-two", settings_env, "--memory", "local", "--tp", "2")
    try:
        one.wait_ready()
        info = two.wait_ready()
        assert info["tp"]["ranks"] == 2 and info["tp"]["backend"] == "gloo"
        assert info["tp"]["engine_ids"] == ["tp-two", "tp-two-r1"]
        # every rank's pid by rank (rank 1: rank 0's one child), as rank 0 names them to its agent too
        rank1 = Path(f"/proc/{info['pid']}/task/{info['pid']}/children").read_text().split()
        assert info["tp"]["pids"] == {"0": info["pid"], "1": int(rank1[0])} and len(rank1) == 1
        want = generate(one.url, **PROMPT)["tokens"]
        assert generate(two.url, **PROMPT)["tokens"] == want
        resumed = generate(two.url, **{**PROMPT, "max_tokens": 30}, resume=want[:10])  # a router's replay
        assert resumed["tokens"] == want[10:]
    finally:
        one.stop()
        two.stop()


async def test_a_frozen_gang_is_taken_over_by_a_new_group_that_serves_the_same_output_without_the_file(
        tmp_path: Path, tiny_weights: Path, two_gpus: Path, settings_env: dict[str, str], settings: CommonSettings,
        bus: Bus) -> None:
    first = engine(tmp_path, tiny_weights, "tp-a", settings_env, "--memory", "leased", "--tp", "2")
    info = first.wait_ready()
    gang = info["tp"]["gang"]
    assert gang["owners"] == ["tp-a", "tp-a-r1"] and gang["generation"] == 1 and len(gang["epochs"]) == 4
    leases = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
    assert {(i.owner, i.gpu, i.tag.value) for i in leases} == {
        ("tp-a", 0, "weights"), ("tp-a", 0, "kv_cache"), ("tp-a-r1", 1, "weights"), ("tp-a-r1", 1, "kv_cache")}
    before = generate(first.url, **PROMPT)["tokens"]
    followers = follower_pids(first.child.pid)
    kill_group(first)
    wait_gone(followers)
    frozen = await bus.request(settings.node, FreezeGang(gang_id="tp-a"), FreezeGangReply)
    assert frozen.generation == 1 and len(frozen.leases) == 4
    assert {i.state for i in frozen.leases} == {LeaseState.FROZEN}
    tiny_weights.rename(tiny_weights.with_suffix(".gone"))  # the new group cannot read the file: leases only

    second = engine(tmp_path, tiny_weights, "tp-b", settings_env, "--memory", "leased", "--tp", "2",
                    HF_TAKEOVER_GANG="tp-a", HF_TRANSFER_TOKEN=frozen.transfer_token, HF_GANG_GENERATION="1")
    try:
        info = second.wait_ready()
        assert info["memory"]["source"] == "takeover"
        assert info["tp"]["gang"]["owners"] == ["tp-b", "tp-b-r1"] and info["tp"]["gang"]["generation"] == 2
        assert generate(second.url, **PROMPT)["tokens"] == before
        after = (await bus.request(settings.node, ListLeases(), ListLeasesReply)).leases
        assert sorted((i.id, i.owner, i.epoch) for i in after) == sorted(
            (i.id, i.owner.replace("tp-a", "tp-b"), i.epoch + 1) for i in frozen.leases)  # the same leases, moved
    finally:
        second.stop()


def test_a_follower_ranks_death_stops_the_whole_group(tmp_path: Path, tiny_weights: Path,
                                                      settings_env: dict[str, str]) -> None:
    group = engine(tmp_path, tiny_weights, "tp-die", settings_env, "--memory", "local", "--tp", "2")
    try:
        group.wait_ready()
        followers = follower_pids(group.child.pid)
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)
        assert group.child.proc.wait(10) == 70  # type: ignore[union-attr]  # rank 0 ends with its group
    finally:
        group.stop()


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "gpus", "extra"), [("nccl", 2, ()), ("gloo", 1, ("--tp-one-gpu",))],
                         ids=["nccl", "one-gpu-gloo"])
def test_two_ranks_on_cuda_serve_the_same_greedy_output_as_one_rank(
        tmp_path: Path, tiny_weights: Path, settings_env: dict[str, str], backend: str, gpus: int,
        extra: tuple[str, ...]) -> None:
    """Over NCCL a GPU per rank; with `--tp-one-gpu` both ranks on GPU 0, their all-reduces through gloo (a
    group's function on one GPU)."""
    import torch

    if torch.cuda.device_count() < gpus:
        pytest.skip("NCCL needs a GPU per rank: two GPUs")
    one = engine(tmp_path, tiny_weights, f"tp-{backend}-one", settings_env, "--memory", "local", "--device", "cuda",
                 "--graphs", "false")  # eager, as the ranks run
    two = engine(tmp_path, tiny_weights, f"tp-{backend}-two", settings_env, "--memory", "local", "--device", "cuda",
                 "--tp", "2", *extra)
    try:
        one.wait_ready(120)
        info = two.wait_ready(120)
        assert info["tp"]["backend"] == backend
        assert generate(two.url, **PROMPT)["tokens"] == generate(one.url, **PROMPT)["tokens"]
    finally:
        one.stop()
        two.stop()


def test_where_each_rank_runs() -> None:
    """Rank r on GPU gpu + r over NCCL (or on rank_gpus[r] when the group names them); on the CPU over gloo;
    `tp_one_gpu`: every rank on GPU gpu over gloo."""
    import torch

    from engines.reference.ranks import rank_place
    from engines.reference.settings import TensorParallelSettings

    plain, one = TensorParallelSettings(tp=4), TensorParallelSettings(tp=4, tp_one_gpu=True)
    assert rank_place(plain, 2, 3, torch.device("cuda")) == (torch.device("cuda", 5), 5, "nccl")
    assert rank_place(one, 2, 3, torch.device("cuda")) == (torch.device("cuda", 2), 2, "gloo")
    assert rank_place(plain, 2, 3, torch.device("cpu")) == (torch.device("cpu"), 5, "gloo")
    assert rank_place(one, 2, 3, torch.device("cpu")) == (torch.device("cpu"), 5, "gloo")
    named = TensorParallelSettings(tp=3, rank_gpus=[0, 2, 3])  # a degraded group on the GPUs a failed one left
    assert [rank_place(named, 0, r, torch.device("cuda"))[1:] for r in range(3)] == [(0, "nccl"), (2, "nccl"),
                                                                                      (3, "nccl")]
    assert rank_place(named, 0, 1, torch.device("cpu")) == (torch.device("cpu"), 2, "gloo")
    with pytest.raises(ValueError, match="one GPU for each of the 4 ranks"):
        rank_place(TensorParallelSettings(tp=4, rank_gpus=[0, 1]), 0, 0, torch.device("cpu"))


def test_the_reference_engine_refuses_a_group_that_does_not_divide_the_kv_heads() -> None:
    """Its cache has as many kv heads in every layer; an uneven group's ranks hold more in some layers than in others
    (engines/reference/tp.py): the batched engine serves those."""
    from engines.reference.settings import EngineSettings
    from engines.reference.tp_runner import run_tp

    with pytest.raises(ValueError, match="does not divide tiny3's 3 kv heads"):
        run_tp(EngineSettings(weights=Path("w.safetensors"), size="tiny3", tp=2))
