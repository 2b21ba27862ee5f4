"""The recovery benchmark's cold restart says where its weights file lived: a file in memory (tmpfs) cannot be
dropped from the page cache, and the output must not claim it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack.scenario import engine_command, in_memory_fs


def _mounts() -> dict[str, str]:
    return {line.split()[1]: line.split()[2] for line in Path("/proc/mounts").read_text().splitlines()}


def test_a_file_on_tmpfs_is_in_memory_and_one_on_a_disk_is_not(tmp_path: Path) -> None:
    mounts = _mounts()
    if mounts.get("/dev/shm") not in ("tmpfs", "ramfs"):
        pytest.skip("no tmpfs at /dev/shm here")
    assert in_memory_fs(Path("/dev/shm/weights.safetensors"))
    assert in_memory_fs(Path("/proc/self/stat")) is False  # procfs: not a page-cache question either way
    root = mounts.get("/")
    assert in_memory_fs(Path("/work-like/weights")) is (root in ("tmpfs", "ramfs"))


def test_every_engine_of_a_benchmark_gets_the_same_kv_capacity_when_asked() -> None:
    argv = engine_command(Path("w.safetensors"), "8b@290", 512)
    assert argv[-2:] == ["--max-seq", "512"]
    assert "--max-seq" not in engine_command(Path("w.safetensors"), "tiny")


def test_a_scenario_removes_only_the_weights_file_it_made_itself(tmp_path: Path) -> None:
    from devstack.scenario import Scenario

    own = Scenario(size="tiny", backend="host", work_dir=tmp_path / "own")
    own.work_dir.mkdir()
    own.weights.write_bytes(b"x")
    shared_file = tmp_path / "shared" / "w.safetensors"
    shared_file.parent.mkdir()
    shared_file.write_bytes(b"x")
    borrower = Scenario(size="tiny", backend="host", work_dir=tmp_path / "b", weights=shared_file)
    own.discard_weights()
    borrower.discard_weights()
    assert not own.weights.exists() and shared_file.exists()


def test_a_benchmark_model_has_about_the_asked_size_and_a_large_one_is_wider_not_deeper() -> None:
    from bench.recovery import size_for
    from engines.reference.config import get_config

    for backend, gib in (("cuda", 16.0), ("cuda", 120.0), ("host", 1.0)):
        cfg = get_config(size_for(backend, gib))
        assert abs(cfg.n_params() * cfg.bytes_per_param() / 2**30 - gib) / gib < 0.03, (backend, gib, cfg.name)
    assert size_for("cuda", 16.0).startswith("8b@") and size_for("cuda", 120.0).startswith("70b@")
    assert get_config(size_for("cuda", 120.0)).n_layers < 100


def test_the_successors_own_moments_land_on_the_deaths_timeline() -> None:
    from devstack.scenario import successor_marks

    marks = successor_marks({"t0_wall": 100.010, "first_generation": {"handler": 12.5}}, t_kill=100.0)
    assert marks == pytest.approx({"successor assigned": 10.0, "successor first request": 22.5})
    assert successor_marks({"first_generation": {"handler": 3.0}}, t_kill=1.0) == {}  # an engine without its origin


def test_the_routers_moments_of_the_successors_route_in_land_on_the_deaths_timeline() -> None:
    from devstack.scenario import router_marks

    route_ins = [{"engine_id": "s", "published": 100.001, "received": 100.002, "first_sent": 100.003},
                 {"engine_id": "other", "published": 100.0, "received": 100.0},
                 {"engine_id": "s", "published": 100.011, "received": 100.012, "first_sent": 100.013,
                  "first_answered": 100.020}]
    marks = router_marks(route_ins, "s", t_kill=100.0)  # the latest addition of the successor counts
    assert marks == pytest.approx({"router received": 12.0, "router first request": 13.0, "router first answer": 20.0})
    assert router_marks(route_ins, "unknown", t_kill=100.0) == {}


def test_a_partial_report_holds_each_way_as_it_ends_the_same_as_the_final_one(tmp_path: Path) -> None:
    """A large model's run may be cut off by a time limit: what it measured so far is on disk."""
    import json
    import subprocess
    import sys

    partial = tmp_path / "partial.json"
    out = subprocess.run([sys.executable, "-m", "holdfast.main", "bench", "recovery", "--backend", "host", "--trials",
                          "1", "--ways", "cold", "--weights-dir", str(tmp_path / "w"), "--partial", str(partial),
                          "--json"], capture_output=True, text=True, timeout=300, check=True)
    final = json.loads(out.stdout)
    assert final["cold_restart"]["death_to_first_token_ms"]["n"] == 1
    assert json.loads(partial.read_text()) == final
    assert (tmp_path / "w").is_dir() and list((tmp_path / "w").glob("*.safetensors"))  # kept for the next call
