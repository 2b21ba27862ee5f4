"""`holdfast bench restore` on the host backend: every source restores the file's bytes (checked by the bench
itself, outside the timed region) and each gets a figure."""

from __future__ import annotations

from pathlib import Path


def test_the_restore_bench_measures_every_source_and_each_restores_the_files_bytes(tmp_path: Path):
    from bench.restore import run

    out = run("host", 0.0625, tmp_path, trials=1, workers=2)
    assert out["verified"] == {"file": True, "artifact-buffered": True, "artifact-direct": True, "host": True}
    assert set(out["gib_s"]) >= {"file", "safetensors", "sol_direct_read", "artifact-buffered", "artifact-direct",
                                 "host"}
    assert all(v > 0 for v in out["gib_s"].values())
    assert out["direct_io"]["artifact-direct"] and not out["direct_io"]["artifact-buffered"]
    assert not any(tmp_path.iterdir())  # the weights file and the artifact are removed
