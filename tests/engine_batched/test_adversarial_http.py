"""The batched engine's HTTP front against clients that do what the router never does (a real engine process, tiny
model, local memory): one request id sent twice, a `/generate_many` naming one id twice or none, bodies the JSON
parser or the router cannot read. Each gets an answer in the engine's error shape and ends; none hangs a stream or
ends another client's."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine_batched.test_front import stream_lines
from tests.engine_batched.test_server import Engine, _many_lines

# Hang detectors, not performance bounds: each of these reads once hung forever.
READ_S = 60


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(tmp_path)
    yield e
    e.child.stop()


def _streaming(url: str, body: dict) -> tuple[list[dict], list[str], threading.Thread]:
    """`body` streaming on a thread, past its first line: its lines, how it ended (once it did), the thread."""
    lines: list[dict] = []
    started, ended = threading.Event(), []
    t = threading.Thread(target=stream_lines, args=(url, body, lines, started, ended), daemon=True)
    t.start()
    assert started.wait(READ_S)
    return lines, ended, t


def test_a_request_id_sent_again_ends_the_older_stream_and_the_newer_one_is_served(engine: Engine) -> None:
    older, ended, t = _streaming(engine.url, {"request_id": "twice", "prompt": "older", "max_tokens": 1800,
                                              "ignore_eos": True})
    newer = httpx.post(engine.url + "/generate", json={"request_id": "twice", "prompt": "newer", "max_tokens": 8,
                                                       "ignore_eos": True}, timeout=READ_S)
    assert newer.status_code == 200 and newer.json()["completion_tokens"] == 8, newer.text
    t.join(READ_S)
    assert ended == ["whole"], ended  # it ended, with a final line; it hung until its client left before
    assert older[-1]["done"] and older[-1]["error"]["code"] == "superseded", older[-1]
    assert engine.health()["engine"]["live"] == 0


def test_the_older_clients_leaving_does_not_end_the_newer_request_with_its_id(engine: Engine) -> None:
    """The older one's client leaving aborted the id at the engine: by then the newer sequence's."""
    with httpx.stream("POST", engine.url + "/generate", json={"request_id": "again", "prompt": "older", "stream": True,
                                                              "max_tokens": 1800, "ignore_eos": True},
                      timeout=READ_S) as r:
        lines = r.iter_lines()
        next(lines)
        newer, ended, t = _streaming(engine.url, {"request_id": "again", "prompt": "newer", "max_tokens": 200,
                                                  "ignore_eos": True})
    # the older client is gone now, after the newer one started
    t.join(READ_S)
    assert ended == ["whole"], ended
    assert newer[-1]["done"] and newer[-1].get("completion_tokens") == 200, newer[-1]


def test_a_generate_many_naming_one_id_twice_ends_with_a_final_line_for_each(engine: Engine) -> None:
    bodies = [{"request_id": "dup", "prompt": "one", "max_tokens": 6, "ignore_eos": True, "stream": True},
              {"request_id": "dup", "prompt": "two", "max_tokens": 6, "ignore_eos": True, "stream": True}]
    lines = _many_lines(engine.url, bodies)  # it never ended before (the first request's final line never came)
    assert lines[0][-1]["done"] and lines[0][-1]["error"]["code"] == "superseded", lines[0]
    assert lines[1][-1]["done"] and lines[1][-1]["completion_tokens"] == 6, lines[1]


def test_a_generate_many_without_request_ids_leaves_nothing_behind_in_the_front(engine: Engine) -> None:
    bodies = [{"prompt": f"anon {i}", "max_tokens": 4, "ignore_eos": True, "stream": True} for i in range(5)]
    lines = _many_lines(engine.url, bodies)
    assert all(lines[i][-1]["completion_tokens"] == 4 for i in range(5))
    deadline = time.monotonic() + 10
    while (h := engine.health())["front_requests"]:  # each request's registration went with its request
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def test_bodies_and_routes_the_api_cannot_serve_get_its_typed_error_shape(engine: Engine) -> None:
    post = {"content-type": "application/json"}
    for raw in (b'{"prompt": "\xff\xfe", "max_tokens": 3}', b"[" * 100_000 + b"]" * 100_000,
                b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"):
        r = httpx.post(engine.url + "/generate", content=raw, headers=post, timeout=READ_S)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json", r.text
    for method, path, status, code in (("GET", "/nowhere", 404, "not_found"), ("GET", "/generate", 405,
                                                                               "method_not_allowed")):
        r = httpx.request(method, engine.url + path, timeout=READ_S)
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert httpx.post(engine.url + "/generate", json={"prompt": "still", "max_tokens": 2},
                      timeout=READ_S).status_code == 200


def test_a_client_that_gives_up_on_a_whole_request_frees_its_blocks_at_once(engine: Engine) -> None:
    """As a stream's client leaving does (test_server.py): the whole request generated on to its end before."""
    total = engine.health()["engine"]["scheduler"]["num_blocks"]
    try:
        httpx.post(engine.url + "/generate", json={"prompt": "a long one", "max_tokens": 1900, "ignore_eos": True},
                   timeout=httpx.Timeout(READ_S, read=1.0))
    except httpx.ReadTimeout:
        pass
    deadline = time.monotonic() + READ_S
    while True:
        sched = engine.health()["engine"]["scheduler"]
        if sched["running"] == 0 and sched["aborted"] == 1:  # aborted, not run to its end
            break
        assert time.monotonic() < deadline, sched
        time.sleep(0.05)
    assert sched["free_blocks"] == total and engine.health()["in_flight"] == 0
    assert httpx.post(engine.url + "/generate", json={"prompt": "next", "max_tokens": 3},
                      timeout=READ_S).json()["completion_tokens"] == 3


def test_a_resume_ending_at_eos_ends_there_one_past_it_is_refused_and_a_batch_keeps_the_queue_bound(
        tmp_path: Path) -> None:
    """A stream cut after its EOS line, resumed with that EOS, was generated past it (53 tokens more, `length`); an EOS
    inside a resume too. A `/generate_many` was let past the front's queue bound whole (none of its entries counted
    the ones before it), and the engine's own refusals came without the `status` the front's carry."""
    engine = Engine(tmp_path, "--max-waiting", "4", "--max-num-seqs", "4")
    try:
        base = {"prompt": "resumed", "max_tokens": 40, "temperature": 0.0}
        for stream in (False, True):
            r = httpx.post(engine.url + "/generate", json={**base, "resume": [65, 257], "stream": stream},
                           timeout=READ_S)
            final = r.json() if not stream else [json.loads(x) for x in r.text.splitlines() if x.strip()][-1]
            assert r.status_code == 200 and final["finish_reason"] == "eos", r.text
            assert final["completion_tokens"] == 0, final
        r = httpx.post(engine.url + "/generate", json={**base, "resume": [65, 257, 66]}, timeout=READ_S)
        assert r.status_code == 400 and "EOS" in r.json()["error"]["message"], r.text
        r = httpx.post(engine.url + "/generate", json={**base, "max_tokens": 3, "resume": [65, 257, 66],
                                                       "ignore_eos": True}, timeout=READ_S)
        assert r.status_code == 200 and r.json()["completion_tokens"] == 3, r.text  # past EOS, as asked
        bodies = [{"prompt": f"many {i}", "max_tokens": 30, "ignore_eos": True, "stream": True} for i in range(40)]
        lines = _many_lines(engine.url, bodies)
        served = [i for i, ls in lines.items() if ls[-1].get("completion_tokens") == 30]
        refused = [ls[-1] for ls in lines.values() if "error" in ls[-1]]
        by_front = [f for f in refused if "engine_id" not in f]  # the engine's own refusals name it
        assert len(by_front) == 32 and len(served) + len(refused) == 40, (len(served), len(by_front), len(refused))
        assert served, "none served"  # of the 8 let in (4 running + 4 waiting), the engine may refuse some
        assert all(f["status"] == 503 and f["error"]["code"] == "queue_full" for f in refused), refused[:3]
    finally:
        engine.child.stop()
