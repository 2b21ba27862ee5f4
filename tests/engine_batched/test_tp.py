"""The batched engine tensor-parallel (`--tp 2`: two rank processes, gloo on the CPU): a batch of prompts served
together gives, prompt for prompt, the greedy tokens of one rank (deterministic mode); a SIGTERM ends both ranks
cleanly; a SIGKILL of rank 1 while it serves ends rank 0 within a bound, and its port stops answering."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from engines.batched.config import EngineConfig
from engines.batched.tp_group import RankGroup
from engines.reference.config import get_config
from engines.reference.weights import make_weights
from libs.common import procs
from tests.engine.conftest import tiny_weights  # noqa: F401 - fixture
from tests.engine.support import EngineProc, generate

ARGS = ("--memory", "local", "--agent", "off", "--deterministic", "--max-num-seqs", "16",
        "--max-num-batched-tokens", "128", "--prefill-chunk", "32")
PROMPTS = 8
DEATH_BOUND_S = 5.0  # rank 1's SIGKILL to rank 0's exit (the watch polls every 50 ms; the machine is shared)


def batched(tmp: Path, weights: Path, engine_id: str, *args: str, size: str = "tiny") -> EngineProc:
    command = [sys.executable, "-m", "engines.batched", "--weights", str(weights), "--size", size]
    return EngineProc(tmp, weights, engine_id, args=(*ARGS, *args), command=command).start()


def body(i: int, **kw: object) -> dict:
    return {"prompt": f"rank {i} holds a shard " + "z" * (i * 7), "max_tokens": 40, "ignore_eos": True, **kw}


def batch_of_prompts(url: str) -> list[list[int]]:
    """Every prompt sent at once: they run in the same steps, prefill chunks beside decodes."""
    with ThreadPoolExecutor(PROMPTS) as ex:
        return list(ex.map(lambda i: generate(url, **body(i))["tokens"], range(PROMPTS)))


FRONT_GONE_S = 2.0


def test_two_ranks_sharded_unevenly_give_each_prompt_the_greedy_tokens_of_one_rank(tmp_path: Path) -> None:
    """tiny3's 3 kv heads over 2 ranks: in layer 0 rank 0 holds 2 (and 4 query heads) and rank 1 one, in layer 1 the
    other way round (engines/reference/tp.py, the cyclic placement), as a degraded group of N-1 ranks is sharded."""
    weights = make_weights(get_config("tiny3"), tmp_path / "tiny3.safetensors", seed=5)
    one = batched(tmp_path, weights, "btu-one", size="tiny3")
    two = batched(tmp_path, weights, "btu-two", "--tp", "2", size="tiny3")
    try:
        one.wait_ready(180)
        info = two.wait_ready(180)
        assert info["tp"]["ranks"] == 2
        # rank 0: 2 of layer 0's 3 kv heads and 1 of layer 1's (the cyclic placement): half the cache, not 2/3
        assert info["memory"]["kv_bytes"] * 2 == one.info["memory"]["kv_bytes"]
        want = batch_of_prompts(one.url)
        assert len({tuple(t) for t in want}) >= PROMPTS // 2  # the prompts lead somewhere different
        assert batch_of_prompts(two.url) == want
    finally:
        one.stop()
        two.stop()


def follower_pids(rank0: int, front: int) -> list[int]:
    """Rank 0's children but its HTTP front (front.py)."""
    children = Path(f"/proc/{rank0}/task/{rank0}/children")
    return [int(p) for p in children.read_text().split() if int(p) != front] if children.exists() else []


def test_two_ranks_give_each_prompt_of_a_batch_the_greedy_tokens_of_one_rank(tmp_path: Path,
                                                                             tiny_weights: Path) -> None:  # noqa: F811
    one = batched(tmp_path, tiny_weights, "btp-one")
    two = batched(tmp_path, tiny_weights, "btp-two", "--tp", "2")
    try:
        one.wait_ready(180)
        info = two.wait_ready(180)
        assert info["tp"]["ranks"] == 2 and info["tp"]["backend"] == "gloo"
        assert info["tp"]["engine_ids"] == ["btp-two", "btp-two-r1"]
        # every rank's pid by rank (rank 1: rank 0's one child but its HTTP front), as rank 0 names them to its
        # agent too
        rank1 = follower_pids(info["pid"], info["front"]["pid"])
        assert info["tp"]["pids"] == {"0": info["pid"], "1": rank1[0]} and len(rank1) == 1
        assert info["memory"]["kv_bytes"] * 2 == one.info["memory"]["kv_bytes"]  # rank 0 holds half the kv heads
        want = batch_of_prompts(one.url)
        assert len({tuple(t) for t in want}) == PROMPTS and all(len(t) == 40 for t in want)
        assert batch_of_prompts(two.url) == want
        followers = follower_pids(two.child.pid, info["front"]["pid"])
        assert len(followers) == 1
        assert two.child.stop(30) == 0  # SIGTERM: rank 0 tells rank 1 to stop, both exit
        assert not any(procs.pid_alive(p) for p in followers)
        assert "rank 1 stopped after" in two.log()
    finally:
        one.stop()
        two.stop()


def stream_until_cut(url: str, i: int, streaming: threading.Event, ended: list[str]) -> None:
    """A long generation; `ended` gets its finish reason, or "cut" when its stream ended without one."""
    reason = "cut"
    try:
        with httpx.stream("POST", url + "/generate", json=body(i, stream=True, max_tokens=1500), timeout=60) as r:
            for line in r.iter_lines():
                obj = json.loads(line)
                streaming.set()
                reason = obj.get("finish_reason") or reason
    except httpx.HTTPError:
        pass
    ended.append(reason)


@pytest.mark.parametrize("serving", [True, False], ids=["serving", "idle"])
def test_a_killed_rank_ends_the_group_within_a_bound_and_its_port_stops_answering(
        tmp_path: Path, tiny_weights: Path, serving: bool) -> None:  # noqa: F811
    """Serving: rank 0 is in the collectives of a step. Idle: it issues none, and must still see rank 1 go."""
    group = batched(tmp_path, tiny_weights, "btp-die", "--tp", "2")
    try:
        front = group.wait_ready(180)["front"]["pid"]
        port = int(group.url.rsplit(":", 1)[1])
        streaming, ended = threading.Event(), []
        threads = [threading.Thread(target=stream_until_cut, args=(group.url, i, streaming, ended), daemon=True)
                   for i in range(4 if serving else 0)]
        for t in threads:
            t.start()
        assert not serving or streaming.wait(60), group.log()
        (follower,) = follower_pids(group.child.pid, front)
        t0 = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        assert group.child.proc.wait(DEATH_BOUND_S + 30) == 70, group.log()  # type: ignore[union-attr]
        took = time.monotonic() - t0
        assert took < DEATH_BOUND_S, f"rank 0 exited {took:.1f} s after rank 1's death"
        deadline = time.monotonic() + FRONT_GONE_S  # its HTTP front exits on its link's end (front_link.py)
        while procs.port_open(port) or procs.pid_alive(front):
            assert time.monotonic() < deadline, f"port {port} or its front still there {FRONT_GONE_S} s after rank 0"
            time.sleep(0.01)
        for t in threads:
            t.join(30)
        assert ended == ["cut"] * len(threads)  # every stream was cut short, none ended as if whole
        assert "rank 1 (pid" in group.log() or "Connection" in group.log()
    finally:
        group.stop()


def test_rank_zeros_death_ends_the_other_rank(tmp_path: Path, tiny_weights: Path) -> None:  # noqa: F811
    group = batched(tmp_path, tiny_weights, "btp-head", "--tp", "2")
    try:
        front = group.wait_ready(180)["front"]["pid"]
        (follower,) = follower_pids(group.child.pid, front)
        group.child.kill(signal.SIGKILL)
        deadline = time.monotonic() + DEATH_BOUND_S
        while procs.pid_alive(follower):
            assert time.monotonic() < deadline, "rank 1 outlived rank 0"
            time.sleep(0.05)
    finally:
        group.stop()


@pytest.mark.parametrize("orders", [{}, {"transfer_token": "t" * 16, "takeover_gang": "g-old", "gang_generation": 1},
                                    {"transfer_token": "t" * 16, "memory": "local"}],
                         ids=["no-token", "and-a-gang", "local-memory"])
def test_a_group_refuses_what_it_cannot_do_before_starting_a_rank(tmp_path: Path, orders: dict) -> None:
    """HF_TAKEOVER_FROM on a group: a single engine's KV backup to regroup from (degrade.py), never without its token
    and leases, nor beside a gang (a group's is taken over through its gang)."""
    cfg = EngineConfig(weights=tmp_path / "w.safetensors", tp=2, takeover_from="e-old", **orders)
    with pytest.raises(ValueError, match="HF_TAKEOVER_FROM on a group"):
        RankGroup(cfg, torch.device("cpu"))


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_over_gloo_give_the_greedy_tokens_of_one_rank(tmp_path: Path,
                                                                          tiny_weights: Path) -> None:  # noqa: F811
    """`--tp-one-gpu`: a group's function on a machine of one GPU (NCCL refuses two ranks on one GPU): both ranks on
    GPU 0, their collectives through gloo, every prompt's greedy tokens those of one rank on the same GPU."""
    cuda = ("--device", "cuda", "--num-blocks", "256")
    one = batched(tmp_path, tiny_weights, "btp-cuda-one", *cuda)
    two = batched(tmp_path, tiny_weights, "btp-cuda-two", *cuda, "--tp", "2", "--tp-one-gpu")
    try:
        one.wait_ready(180)
        info = two.wait_ready(180)
        assert info["tp"]["ranks"] == 2 and info["tp"]["backend"] == "gloo"
        want = batch_of_prompts(one.url)
        assert len({tuple(t) for t in want}) == PROMPTS
        assert batch_of_prompts(two.url) == want
        assert two.child.stop(30) == 0
    finally:
        one.stop()
        two.stop()
