"""A warm standby's runner built before the failure (engines/batched/__main__.py `prepare_runner`): over addresses it
reserved for its predecessor's weights and KV cache (placeholder memory of its own until then), its graphs captured
on CUDA. After the takeover maps the predecessor's leases into those reservations the same runner serves, with the
greedy tokens the predecessor served (real gpu_manager on the host backend, a real engine process, a real SIGKILL).
A handed-on KV lease of another size lands elsewhere: the standby notices and builds a new runner."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
import torch

from engines.batched.__main__ import adopt_prepared, can_reserve, new_runner, prepare_runner
from engines.batched.config import parse_config
from engines.batched.memory import LeasedMemory, Loaded, layout_fn, placement
from engines.batched.model_runner import ModelRunner, RunItem
from engines.reference.config import get_config
from libs.client.protocol import TensorMeta
from libs.common import tokenizer
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import Freeze, FreezeReply
from tests.engine.conftest import gpu_manager, tiny_weights  # noqa: F401 - fixtures
from tests.engine_batched.test_failover import ARGS as ENGINE_ARGS
from tests.engine_batched.test_failover import BatchedEngine

# after test_failover's ARGS (BatchedEngine's), which these override
ARGS = ("--max-num-seqs", "8", "--max-model-len", "256", "--num-blocks", "64", "--device", "cpu")
PROMPT = "the standby was ready"  # one prefill chunk (< 32 tokens): the engine runs it as this test does
TOKENS = 24


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """One sequence alone, as the engine runs it: the prompt as one chunk, then one token a step."""
    table = list(range(-(-(len(prompt) + n) // 16)))
    out = [runner.run([RunItem(token_ids=prompt, start=0, block_table=table, sample=True)])[0]]
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        out.append(runner.run([RunItem(token_ids=[out[-1]], start=pos, block_table=table, sample=True)])[0])
    return [t for t in out if t is not None]


async def _served_then_frozen(tmp: Path, weights: Path, env: dict[str, str], bus: Bus, node: str,
                              *extra: str) -> tuple[list[int], str]:
    """The predecessor's greedy answer to PROMPT; then it is frozen, SIGKILLed, and its transfer token returned."""
    first = BatchedEngine(tmp, weights, "bat-pred", env, *ARGS, *extra)
    await asyncio.to_thread(first.wait_ready)
    r = await asyncio.to_thread(httpx.post, first.url + "/generate",
                                json={"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True}, timeout=60)
    r.raise_for_status()
    frozen = await bus.request(node, Freeze(owner="bat-pred", incident_id="inc-prepared"), FreezeReply)
    await asyncio.to_thread(first.kill)
    return r.json()["tokens"], frozen.transfer_token


def _standby(socket: Path, weights: Path, *extra: str):  # noqa: ANN202
    cfg = parse_config(["--weights", str(weights), "--id", "bat-sb", *ENGINE_ARGS, *ARGS, *extra])
    memory = LeasedMemory("bat-sb", socket_path=str(socket), gpu=0)
    mcfg = get_config(cfg.size)
    device = torch.device(cfg.device)
    layout_of = layout_fn(cfg, mcfg, device)
    assert can_reserve(cfg, memory, device)
    return cfg, mcfg, memory, layout_of


@pytest.mark.timeout(180)
async def test_the_runner_built_before_the_takeover_serves_the_predecessors_tokens_at_the_same_addresses(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],  # noqa: F811
        settings: CommonSettings, bus: Bus) -> None:
    cfg, mcfg, memory, layout_of = _standby(gpu_manager, tiny_weights)
    try:
        prepared = prepare_runner(cfg, mcfg, memory, layout_of)
        reserved, runner, _ = prepared
        prompt = tokenizer.encode(PROMPT)
        before = greedy(runner, prompt, TOKENS)  # over the placeholder: not the model's answer

        expected, token = await _served_then_frozen(tmp_path, tiny_weights, settings_env, bus, settings.node)
        loaded: Loaded = memory.takeover(mcfg, "bat-pred", token, layout_of, 30.0, known=reserved)
        assert memory.client.last_timings_ms["reserved"] == 2  # weights and KV cache, into their reservations
        assert loaded.kv.data_ptr() == reserved.kv.data_ptr() and loaded.kv_handed_on
        # the views the standby built over the reservations are the takeover's own: none built again
        assert all(loaded.weights[n] is t for n, t in reserved.weights.items())
        assert reserved.fused and all(loaded.fused[n] is t for n, t in reserved.fused.items())
        # taken whole: the lease lies where and as the reservation's tensors were laid out (none checked one by one)
        assert loaded.timings_ms["views_reused"] == len(reserved.weights) + len(reserved.fused)
        reused, how = adopt_prepared(prepared, loaded)
        assert reused is runner and how == "reused"

        assert before != expected
        assert greedy(runner, prompt, TOKENS) == expected  # the same runner, now over the predecessor's memory
        assert greedy(new_runner(cfg, mcfg, loaded), prompt, TOKENS) == expected
    finally:
        memory.close()


def test_a_placement_differs_in_any_tensor_or_address_and_not_in_how_contiguous_strides_are_said() -> None:
    def meta(name: str, offset: int, shape: list[int], stride: list[int] | None = None) -> TensorMeta:
        return TensorMeta(name=name, lease_id="any", offset=offset, shape=shape, dtype="bfloat16", stride=stride)

    metas = [meta("a", 0, [4, 8]), meta("b", 64, [8])]
    key = placement(4096, metas)
    assert placement(4096, [meta("b", 64, [8], [1]), meta("a", 0, [4, 8], [8, 1])]) == key  # order, said strides
    assert placement(8192, metas) != key  # another address
    assert placement(4096, [meta("a", 0, [4, 8]), meta("b", 80, [8])]) != key  # a tensor moved
    assert placement(4096, [meta("a", 0, [8, 4]), meta("b", 64, [8])]) != key  # another shape
    assert placement(4096, [meta("a", 0, [4, 8], [1, 4]), meta("b", 64, [8])]) != key  # transposed
    assert placement(4096, metas[:1]) != key  # one fewer


@pytest.mark.timeout(180)
async def test_a_kv_lease_of_another_size_is_not_served_by_the_prepared_runner(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],  # noqa: F811
        settings: CommonSettings, bus: Bus) -> None:
    cfg, mcfg, memory, layout_of = _standby(gpu_manager, tiny_weights, "--num-blocks", "48")
    try:
        prepared = prepare_runner(cfg, mcfg, memory, layout_of)
        expected, token = await _served_then_frozen(tmp_path, tiny_weights, settings_env, bus, settings.node)
        loaded = memory.takeover(mcfg, "bat-pred", token, layout_of, 30.0, known=prepared[0])
        assert memory.client.last_timings_ms["reserved"] == 1  # the weights only
        assert memory.client.reservations == []  # the KV cache's was freed
        assert loaded.kv.shape[2] == 64 and loaded.kv_handed_on  # the predecessor's cache, kept at its size
        reused, how = adopt_prepared(prepared, loaded)
        assert reused is None and how == "moved: 1 tensors"
        assert greedy(new_runner(cfg, mcfg, loaded), tokenizer.encode(PROMPT), TOKENS) == expected
    finally:
        memory.close()


@pytest.mark.timeout(180)
async def test_a_standby_that_rehearsed_its_takeover_serves_the_predecessors_tokens(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],  # noqa: F811
        settings: CommonSettings, bus: Bus) -> None:
    """rehearsal.py on the CPU (on by default on CUDA only): its three acts ran through over the placeholders (every
    request recovered, adopted and claimed again), nothing of them runs on, and the takeover that follows serves the
    predecessor's greedy tokens with the same runner."""
    cfg, mcfg, memory, layout_of = _standby(gpu_manager, tiny_weights, "--rehearse", "on")
    try:
        prepared = prepare_runner(cfg, mcfg, memory, layout_of)
        reserved, runner, info = prepared
        played = info["rehearsal"]
        assert "failed" not in played, played
        # 7 of the journal's 8 slots (one left for the isolated row to move to), its pending block copied
        assert played["recovered"] == played["adopted"] == played["claimed"] == 7 and played["copied"] == 1, played
        assert not [t for t in threading.enumerate() if t.name == "engine-step"]
        expected, token = await _served_then_frozen(tmp_path, tiny_weights, settings_env, bus, settings.node)
        loaded = memory.takeover(mcfg, "bat-pred", token, layout_of, 30.0, known=reserved)
        assert adopt_prepared(prepared, loaded) == (runner, "reused")
        assert greedy(runner, tokenizer.encode(PROMPT), TOKENS) == expected
    finally:
        memory.close()


@pytest.mark.timeout(120)
async def test_the_rehearsal_runs_beside_a_reservation_larger_than_its_placeholder(
        tiny_weights: Path, gpu_manager: Path) -> None:  # noqa: F811
    """A reservation's placeholder is one block mapped again and again (libs/client/mapping.py): a cache of 32k blocks
    aliases its own journal there. The rehearsal runs over scratch memory of its own, so it plays through anyway; its
    context is its prompts' (a scheduler refuses a cache that cannot hold one sequence of its context: the
    configuration's 2048 would have made it larger than its prompts need)."""
    cfg, mcfg, memory, layout_of = _standby(gpu_manager, tiny_weights, "--rehearse", "on", "--num-blocks", "32768",
                                            "--max-model-len", "2048")
    try:
        _, _, info = prepare_runner(cfg, mcfg, memory, layout_of)
        played = info["rehearsal"]
        assert "failed" not in played and played["adopted"] == played["claimed"] == 7, played
        assert played["context"] < 2048 and played["cache_blocks"] < 2048 // 16, played  # its prompts' size
    finally:
        memory.close()
