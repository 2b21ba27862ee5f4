"""The reference engine over Holdfast leases (real gpu_manager, host backend, real processes and signals):
the weights survive a SIGKILL, and a new process serves identical greedy output from them without the file."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import Freeze, FreezeReply
from tests.engine.support import EngineProc, generate, in_flight

PROMPT = {"prompt": "Weights outlive the engine.", "max_tokens": 48, "ignore_eos": True}
PROMPT_TOKENS = 1 + len("Weights outlive the engine.")  # BOS + bytes


def leased_engine(tmp: Path, weights: Path, engine_id: str, env: dict[str, str], **extra_env: str) -> EngineProc:
    return EngineProc(tmp, weights, engine_id, env={**env, **extra_env}, args=("--memory", "leased")).start()


def kill(e: EngineProc) -> None:
    e.child.kill(signal.SIGKILL)
    e.child.proc.wait(10)  # type: ignore[union-attr]


async def test_a_new_process_reattaches_the_leases_and_its_greedy_output_is_identical(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str]) -> None:
    first = leased_engine(tmp_path, tiny_weights, "eng-1", settings_env)
    info = first.wait_ready()
    assert info["memory"]["kind"] == "leased" and info["memory"]["source"] == "file"
    before = generate(first.url, **PROMPT)
    kill(first)
    tiny_weights.rename(tiny_weights.with_suffix(".gone"))  # the successor cannot read the file: leases only

    second = leased_engine(tmp_path, tiny_weights, "eng-1", settings_env)
    info = second.wait_ready()
    try:
        assert info["memory"]["source"] == "reattached"
        assert info["recovery"]["first_token_ms"] > 0
        after = generate(second.url, **PROMPT)
        assert after["tokens"] == before["tokens"] and after["text"] == before["text"]
    finally:
        second.stop()


async def test_a_request_resumed_after_a_reattach_continues_in_place_from_the_killed_engines_cache(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str]) -> None:
    first = leased_engine(tmp_path, tiny_weights, "eng-kv", settings_env)
    first.wait_ready()
    whole = generate(first.url, **PROMPT)["tokens"]
    with in_flight(first.url, 5, **PROMPT) as sent:
        kill(first)
    assert sent == whole[:5]

    second = leased_engine(tmp_path, tiny_weights, "eng-kv", settings_env)
    info = second.wait_ready()
    try:
        assert info["memory"]["source"] == "reattached"
        resumed = generate(second.url, **{**PROMPT, "max_tokens": PROMPT["max_tokens"] - 5}, resume=sent)  # a router's replay
        assert resumed["tokens"] == whole[5:]
        reused = httpx.get(second.url + "/health", timeout=10).json()["kv_reused"]
        # The prompt and the tokens sent came from the cache the killed engine left, in place: one forward. The
        # generation was in flight at the kill (continued at start-up, then taken) unless the tiny model had
        # finished it by then.
        assert reused["requests"] == 1 and reused["positions"] >= PROMPT_TOKENS + 4 and reused["refused"] == 0
        assert reused["continued_taken"] <= reused["continued"] <= 1
        assert generate(second.url, **PROMPT)["tokens"] == whole  # a fresh prompt: computed as ever
    finally:
        second.stop()


async def test_a_cold_spawned_successor_takes_over_with_the_transfer_token_and_serves_the_same_output(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],
        settings: CommonSettings, bus: Bus) -> None:
    first = leased_engine(tmp_path, tiny_weights, "eng-a", settings_env)
    first.wait_ready()
    before = generate(first.url, **PROMPT)
    kill(first)
    frozen = await bus.request(settings.node, Freeze(owner="eng-a"), FreezeReply)
    assert len(frozen.lease_ids) == 2  # the weights and the KV cache
    tiny_weights.rename(tiny_weights.with_suffix(".gone"))

    successor = leased_engine(tmp_path, tiny_weights, "eng-b", settings_env,
                              HF_TAKEOVER_FROM="eng-a", HF_TRANSFER_TOKEN=frozen.transfer_token)
    info = successor.wait_ready()
    try:
        assert info["memory"]["source"] == "takeover"
        assert generate(successor.url, **PROMPT)["tokens"] == before["tokens"]
        sampled = {"prompt": "seeded", "max_tokens": 24, "temperature": 0.9, "seed": 11}
        assert generate(successor.url, **sampled)["tokens"] == generate(successor.url, **sampled)["tokens"]
    finally:
        successor.stop()


async def test_the_served_weights_hash_equals_the_files_before_and_after_a_reattach(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str]) -> None:
    import httpx

    from engines.reference.weights import load_weights, weights_sha256

    expected = weights_sha256(load_weights(tiny_weights))
    first = leased_engine(tmp_path, tiny_weights, "eng-sum", settings_env)
    first.wait_ready()
    assert httpx.get(f"{first.url}/checksum", timeout=30).json()["weights_sha256"] == expected
    kill(first)
    second = leased_engine(tmp_path, tiny_weights, "eng-sum", settings_env)
    second.wait_ready()
    try:
        assert httpx.get(f"{second.url}/checksum", timeout=30).json()["weights_sha256"] == expected
    finally:
        second.stop()


def test_named_sizes_take_another_depth_for_benchmarks() -> None:
    from engines.reference.config import get_config

    cfg = get_config("small@3")
    assert cfg.n_layers == 3 and cfg.dim == get_config("small").dim and cfg.name == "small@3"
    for bad in ("small@0", "small@x", "huge"):
        try:
            get_config(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


async def test_an_engine_whose_lease_moved_on_while_the_manager_was_down_stops_serving(
        tmp_path: Path, tiny_weights: Path, settings: CommonSettings, settings_env: dict[str, str], bus: Bus) -> None:
    from tests.engine.conftest import end_processes_of, start_gpu_manager

    manager = start_gpu_manager(settings, settings_env, tmp_path)
    engine = leased_engine(tmp_path, tiny_weights, "eng-cut", settings_env)
    try:
        engine.wait_ready()
        # The control plane freezes its leases for a successor; then the manager dies and comes back.
        await bus.request(settings.node, Freeze(owner="eng-cut"), FreezeReply)
        manager.kill(signal.SIGKILL)
        manager.proc.wait(10)  # type: ignore[union-attr]
        manager = start_gpu_manager(settings, settings_env, tmp_path)
        # On reconnect the engine learns its leases are frozen for someone else: it must not serve on.
        assert engine.child.proc.wait(30) == 75  # type: ignore[union-attr]
    finally:
        engine.stop()
        manager.stop()
        end_processes_of(settings.state_dir)
