"""A tensor-parallel batched engine's weights from the node's copies, rank by rank (issue 22 item 5; real gpu_manager
on the host backend with two simulated GPUs, real rank processes): each rank's committed shard is copied by the
gpu_manager's policy under that rank's own copy name; a new group then cold-starts with every rank restored from the
host tier (the weights file gone) and serves the tokens of a file load; a rank whose copy is corrupt or missing
reads the file and says so, the other rank still restores; a single engine of the same class never takes a rank's
copy. (A peer's copy of a shard: tests/gpu_manager/test_peer_restore.py; here each group is stopped first.)"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from libs.client.memory import MemoryClient
from libs.client.safetensors_io import copy_name
from libs.common.config import CommonSettings
from libs.common.errors import NotFound
from libs.common.events import WeightsLoaded
from tests.engine.conftest import end_processes_of, start_gpu_manager, tiny_weights  # noqa: F401 - fixture
from tests.engine_batched.test_failover import BatchedEngine, alone

GROUP = ("--tp", "2", "--num-blocks", "256")
MIB = 1024 * 1024


@pytest.fixture
def copies_node(settings: CommonSettings, settings_env: dict[str, str], tmp_path: Path,
                request: pytest.FixtureRequest) -> Iterator[Path]:
    """A gpu_manager with GPUs 0 and 1 that copies the `batched` class's weights by policy: to the host tier
    (param "host") or to artifacts (param "artifact"); yields its artifact directory."""
    artifacts = tmp_path / "artifacts"
    policy = ({"HF_HOST_TIER_CLASSES": '["batched"]', "HF_HOST_TIER_BYTES": str(256 * MIB)} if request.param == "host"
              else {"HF_SNAPSHOT_CLASSES": '["batched"]'})
    child = start_gpu_manager(settings, {**settings_env, "HF_GPUS": json.dumps(["0", "1"]),
                                         "HF_ARTIFACT_DIR": str(artifacts), "HF_ARTIFACT_BLOCK_BYTES": str(MIB),
                                         "HF_ARTIFACT_FILE_BYTES": str(2 * MIB), **policy}, tmp_path)
    yield artifacts
    child.stop()
    end_processes_of(settings.state_dir)


def copy_source(settings: CommonSettings, name: str, gpu: int) -> str | None:
    """Where the node restores copy `name` from (host, artifact), or None: a real restore, released at once."""
    c = MemoryClient.connect(f"probe-{time.monotonic_ns()}", socket_path=str(settings.state_dir / "gpu_manager.sock"),
                             engine_class="probe")
    try:
        lease = c.restore(name, gpu=gpu)
        c.release(lease.id)
        return str(c.last_restore["source"])
    except NotFound:
        return None
    finally:
        c.close()


def wait_copies(settings: CommonSettings, where: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    names = [copy_name("batched", tp=2, rank=r) for r in range(2)]
    while any(copy_source(settings, n, r) != where for r, n in enumerate(names)):
        assert time.monotonic() < deadline, f"no {where} copies {names} after {timeout} s"
        time.sleep(0.2)


def cold_group(tmp: Path, weights: Path, engine_id: str, env: dict[str, str]) -> tuple[dict, list[list[int]]]:
    """A TP=2 group cold-started: (its ready info, the greedy tokens of three prompts, sent at once: every group
    is asked the same way, and deterministic mode makes a batch compute what each alone would), then stopped."""
    e = BatchedEngine(tmp, weights, engine_id, env, *GROUP)
    try:
        info = e.wait_ready(180)
        with ThreadPoolExecutor(3) as pool:
            return info, list(pool.map(lambda i: alone(e.url, i), range(3)))
    finally:
        assert e.child.stop(30) == 0, e.log()


@pytest.mark.parametrize("copies_node", ["host"], indirect=True)
def test_a_group_cold_starts_with_every_rank_restored_from_the_host_tier(
        copies_node: Path, settings: CommonSettings, settings_env: dict[str, str], tmp_path: Path,
        tiny_weights: Path) -> None:  # noqa: F811
    first, want = cold_group(tmp_path, tiny_weights, "bwc-a", settings_env)
    assert first["memory"]["weights"]["ranks"] == ["file", "file"]
    wait_copies(settings, "host")
    tiny_weights.rename(tiny_weights.with_suffix(".gone"))  # from here, a read of the file fails

    info, got = cold_group(tmp_path, tiny_weights, "bwc-b", settings_env)
    weights = info["memory"]["weights"]
    assert weights["source"] == "host" and weights["ranks"] == ["host", "host"] and "refused" not in weights
    assert all(r["source"] == "host" and r["restore"]["bytes"] > 0 for r in weights["per_rank"])
    assert got == want  # every rank's restored shard computes what the file's did
    line = WeightsLoaded.model_validate({k: weights[k] for k in ("source", "load_ms", "ranks")}).describe()
    assert line.startswith("weights from host (2 ranks) in "), line
    print(f"TP=2 cold start from the host tier: {line}; per rank {weights['per_rank']}")  # noqa: T201


@pytest.mark.parametrize("copies_node", ["artifact"], indirect=True)
def test_a_rank_whose_copy_is_corrupt_or_missing_reads_the_file_and_says_so(
        copies_node: Path, settings: CommonSettings, settings_env: dict[str, str], tmp_path: Path,
        tiny_weights: Path) -> None:  # noqa: F811
    _, want = cold_group(tmp_path, tiny_weights, "bwc-c", settings_env)
    wait_copies(settings, "artifact")
    rank1 = copies_node / copy_name("batched", tp=2, rank=1)
    with open(rank1 / "data-000.bin", "r+b") as f:
        f.write(b"\xff" * 16)

    info, got = cold_group(tmp_path, tiny_weights, "bwc-d", settings_env)
    weights = info["memory"]["weights"]
    assert weights["ranks"] == ["artifact", "file"] and weights["source"] == "file" and got == want
    assert weights["refused"].startswith("rank 1: artifact_invalid"), weights
    assert "refused" not in weights["per_rank"][0]

    for f in rank1.iterdir():  # rank 1's copy gone: the file, nothing refused
        f.unlink()
    rank1.rmdir()
    info, got = cold_group(tmp_path, tiny_weights, "bwc-e", settings_env)
    weights = info["memory"]["weights"]
    assert weights["ranks"] == ["artifact", "file"] and "refused" not in weights and got == want
    line = WeightsLoaded.model_validate({k: weights[k] for k in ("source", "load_ms", "ranks")}).describe()
    assert line.startswith("weights from artifact (rank 0), file (rank 1) in "), line


@pytest.mark.parametrize("copies_node", ["artifact"], indirect=True)
def test_a_single_engine_of_the_class_never_takes_a_ranks_copy(
        copies_node: Path, settings: CommonSettings, settings_env: dict[str, str], tmp_path: Path,
        tiny_weights: Path) -> None:  # noqa: F811
    cold_group(tmp_path, tiny_weights, "bwc-f", settings_env)
    wait_copies(settings, "artifact")
    assert copy_source(settings, copy_name("batched"), 0) is None  # no whole model's copy: only the ranks'

    single = BatchedEngine(tmp_path, tiny_weights, "bwc-g", settings_env, "--num-blocks", "256")
    try:
        weights = single.wait_ready(180)["memory"]["weights"]
        assert weights["source"] == "file" and "refused" not in weights and "ranks" not in weights
    finally:
        assert single.child.stop(30) == 0, single.log()
