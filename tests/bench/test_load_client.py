"""The load bench's client: the NDJSON parser (pure), the light reader's kernel stamps against a real server whose
write times are known, and the worker processes' rounds."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.load_client import ClientPool, Job, Result, read_generation
from bench.ndjson_http import NdjsonResponse, ResponseError
from tests.bench.ndjson_server import NdjsonServer

LINES = [{"token": 7, "text": "a"}, {"token": 8, "text": "b"}, {"token": 9, "text": "c"}, {"done": True}]


def chunked(lines: list[dict]) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: application/x-ndjson\r\n\r\n"
    for obj in lines:
        line = json.dumps(obj).encode() + b"\n"
        out += b"%x\r\n%s\r\n" % (len(line), line)
    return out + b"0\r\n\r\n"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=12))
def test_any_split_of_the_bytes_gives_the_same_tokens_stamped_by_the_read_that_ended_each_line(cuts):
    data = chunked(LINES)
    bounds = sorted({min(c, len(data)) for c in cuts} | {len(data)})
    r, start = NdjsonResponse(), 0
    line_ends = [data.index(json.dumps(o).encode() + b"\n") + len(json.dumps(o)) for o in LINES[:3]]
    for stamp, end in enumerate(bounds):
        r.feed(data[start:end], float(stamp), float(stamp) + 0.5)
        start = end
    assert r.tokens == [7, 8, 9] and r.text == "abc" and r.done and r.finished and r.error is None
    expect = [float(next(i for i, b in enumerate(bounds) if b > pos)) for pos in line_ends]
    assert r.arrivals == expect and r.parsed == [a + 0.5 for a in expect]


def test_a_stream_cut_before_its_closing_line_is_an_error_not_done():
    r = NdjsonResponse()
    r.feed(chunked(LINES)[:120], 1.0, 1.0)
    r.feed(b"", 2.0, 2.0)
    assert r.finished and not r.done and r.error == "the stream ended without its closing line"


def test_an_error_status_carries_its_body():
    r = NdjsonResponse()
    r.feed(b'HTTP/1.1 503 Service Unavailable\r\ncontent-length: 15\r\n\r\n{"detail":"no"}', 1.0, 1.0)
    assert r.finished and not r.done and r.error == 'HTTP 503: {"detail":"no"}'


def test_the_engines_error_line_ends_the_stream_as_an_error():
    r = NdjsonResponse()
    r.feed(chunked([{"token": 1}, {"done": True, "error": {"type": "engine_lost"}}]), 1.0, 1.0)
    assert r.finished and not r.done and r.tokens == [1] and json.loads(r.error) == {"type": "engine_lost"}


def test_bytes_that_are_not_http_are_a_typed_error():
    with pytest.raises(ResponseError):
        NdjsonResponse().feed(b"SSH-2.0-OpenSSH\r\n\r\n", 1.0, 1.0)


async def test_a_token_is_stamped_when_it_came_even_while_the_readers_loop_is_blocked():
    """The defect of the in-loop httpx reader: a token that came while its loop was busy got the time the loop
    parsed it. The server writes token 1 while this loop sleeps; its stamp must be its arrival. (Tokens that come
    together in one read share the latest one's stamp: at or after each one's arrival, never before.)"""
    server = NdjsonServer([0.0, 0.15, 0.4])
    try:
        out = Result(0)
        body = {"model": "m", "prompt": "p", "max_tokens": 3, "stream": True}
        task = asyncio.create_task(read_generation("127.0.0.1", int(server.url.rsplit(":", 1)[1]), body, out, 10))
        while not out.response.tokens:
            await asyncio.sleep(0.001)
        time.sleep(0.35)  # the loop blocked while token 1 came
        await task
        sent = server.sent[0]
        r = out.response
        assert r.done and r.tokens == [1, 2, 3]
        assert r.parsed[1] - sent[1] > 0.1  # the loop was late
        assert all(0 <= a - s < 0.03 for a, s in zip(r.arrivals, sent, strict=True))  # the stamps were not
    finally:
        server.close()


async def test_worker_processes_run_each_round_and_report_their_loop():
    server = NdjsonServer([0.0, 1.0, 0.02, 0.02])  # each stream's first token long before its end, on a busy host too
    pool = ClientPool(server.url, "m", procs=2)
    try:
        await pool.start([Job(k, "x" * k, 4) for k in range(1, 6)], warm_tokens=1)
        pool.send_late([Job(k, "y" * k, 4) for k in range(10, 13)])
        results, workers = await pool.results()
        assert sorted(results) == [1, 2, 3, 4, 5, 10, 11, 12]
        for k, (sent_at, r) in results.items():
            assert r.done and r.tokens == [k, k + 1, k + 2, k + 3] and sent_at <= r.arrivals[0] <= r.parsed[0]
        assert len(workers) == 2 and all(w["lags"] and 0 <= w["cpu_share"] for w in workers)
    finally:
        pool.close()
        server.close()


async def test_a_refused_stream_is_reported_by_its_worker_not_lost_silently():
    server = NdjsonServer([0.0], status=404)
    pool = ClientPool(server.url, "m", procs=1)
    try:
        with pytest.raises(RuntimeError, match="ended"):
            await pool.start([Job(1, "x", 4)], warm_tokens=1)
    finally:
        pool.close()
        server.close()
