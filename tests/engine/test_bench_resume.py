"""`holdfast bench resume`: every way gives the uninterrupted generation's token, and the reuse ways take every
finished position (tiny size, CPU; the figures themselves are the benchmark's, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.resume import run


def test_a_resumed_request_gets_the_same_token_recomputed_or_from_the_predecessors_cache() -> None:
    out = run("tiny", [1, 8], trials=1, device="cpu")
    assert [r["generated"] for r in out["rows"]] == [1, 8]
    for r in out["rows"]:
        assert r["same_token"] is True
        assert r["positions_reused"] == r["positions_in_place"] == out["prompt_tokens"] + r["generated"] - 1
        assert r["recompute_ms"] > 0 and r["reuse_ms"] > 0 and r["in_place_ms"] > 0


def test_the_cli_prints_the_rows_as_json() -> None:
    r = subprocess.run([sys.executable, "-m", "holdfast.main", "bench", "resume", "--size", "tiny", "--generated",
                        "2", "--trials", "1", "--device", "cpu", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
    assert row["generated"] == 2 and row["same_token"] is True
