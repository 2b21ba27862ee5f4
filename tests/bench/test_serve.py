"""`holdfast bench serve`: its figures from token stamps (pure), and its streams read by the serving benches' one
client (bench/load_client.py) straight from an engine's route, against a real HTTP server on loopback."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from bench.load_client import ClientPool
from bench.serve import ENGINE_PATH, at_concurrency, cli, per_step, serve_row
from tests.bench.ndjson_server import NdjsonServer


def test_a_rows_figures_come_from_each_streams_send_time_and_token_stamps():
    row = serve_row(2, [(10.0, [10.1, 10.2, 10.3]), (10.0, [10.15, 10.35])])
    assert row["concurrency"] == 2 and row["output_tokens"] == 5 and row["wall_s"] == 0.35
    assert row["output_tokens_per_s"] == pytest.approx(5 / 0.35, abs=0.1)
    assert row["ttft_ms"]["max"] == pytest.approx(150) and row["itl_ms"]["max"] == pytest.approx(200)
    assert row["largest_gap_ms"]["p50"] == pytest.approx(150)
    # decode: the 3 tokens after the last first token (10.15), over the 0.2 s to the last token
    assert row["decode_tokens_per_s"] == pytest.approx(15.0)


def test_the_step_threads_figures_are_per_step_between_two_readings():
    before = {"steps": 10, "schedule": 5.0, "launch": 20.0, "wait": 100.0, "resolve": 8.0}
    after = {"steps": 30, "schedule": 15.0, "launch": 60.0, "wait": 100.0, "resolve": 28.0}
    assert per_step(before, after) == {"steps": 20, "schedule": 0.5, "launch": 2.0, "wait": 0.0, "resolve": 1.0}
    assert per_step(after, after) == {"steps": 0, "schedule": None, "launch": None, "wait": None, "resolve": None}


async def test_streams_go_to_the_engines_route_with_no_model_named_and_are_stamped_by_the_client():
    server = NdjsonServer([0.0, 0.01, 0.01, 0.01])
    pool = ClientPool(server.url, None, procs=2, path=ENGINE_PATH)
    try:
        row = await at_concurrency(pool, 3, 16, 4)
    finally:
        pool.close()
        server.close()
    assert row["concurrency"] == 3 and row["output_tokens"] == 12
    assert {path for path, _ in server.requests} == {ENGINE_PATH}
    assert all("model" not in body and body["ignore_eos"] and body["stream"] for _, body in server.requests)
    assert row["client"]["procs"] == 2 and len(row["client"]["cpu_share"]) == 2
    assert row["itl_ms"]["p50"] is not None and row["wall_s"] > 0


async def test_a_burst_of_refused_requests_is_counted_apart_from_the_streams():
    server = NdjsonServer([0.0] + [0.02] * 7, refuse_longer_than=100)
    pool = ClientPool(server.url, None, procs=2, path=ENGINE_PATH)
    try:
        row = await at_concurrency(pool, 3, 16, 8, burst=5, burst_len=200)
    finally:
        pool.close()
        server.close()
    assert row["concurrency"] == 3 and row["output_tokens"] == 24  # the streams' alone
    burst = row["burst"]
    assert (burst["sent"], burst["refused_400"], burst["other"]) == (5, 5, 0)
    assert burst["answered_ms"]["n"] == 5 and burst["answered_ms"]["max"] < 10_000
    assert sum(1 for _, body in server.requests if len(body["prompt"]) == 200) == 5


async def test_a_refused_stream_fails_the_run_with_its_error():
    server = NdjsonServer([0.0], status=404)
    pool = ClientPool(server.url, None, procs=1, path=ENGINE_PATH)
    try:
        with pytest.raises(RuntimeError, match="2 of 2 streams failed.*HTTP 404"):
            await at_concurrency(pool, 2, 16, 4)
    finally:
        pool.close()
        server.close()


@pytest.mark.parametrize(("option", "value"), [("--concurrency", "abc"), ("--concurrency", "0"), ("--concurrency", ","),
                                               ("--tp", ""), ("--tp", "2,x"), ("--tp", "0,1")])
def test_a_bad_list_of_stream_counts_or_group_sizes_is_refused_before_anything_starts(option, value):
    app = typer.Typer()
    app.command()(cli)
    result = CliRunner().invoke(app, ["--size", "tiny", option, value])
    assert result.exit_code == 2 and option in result.output
