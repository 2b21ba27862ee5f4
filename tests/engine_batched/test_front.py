"""The batched engine's HTTP front (front.py, front_link.py): a process of its own that lives and dies with the
engine. Real engine processes (tiny model, CPU), real signals; the frame codec and the front's delivery as pure
logic."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from engines.batched import front_link
from engines.batched.front_link import EngineFrame, FrontFrame, Out, Status, Submit, encode
from engines.batched.http_state import EngineState, Sink
from libs.common import procs
from tests.engine.conftest import tiny_weights  # noqa: F401 - fixture
from tests.engine.support import EngineProc

DEATH_BOUND_S = 5.0


def engine(tmp: Path, weights: Path, engine_id: str) -> EngineProc:
    command = [sys.executable, "-m", "engines.batched", "--weights", str(weights), "--size", "tiny",
               "--memory", "local", "--agent", "off", "--num-blocks", "256"]
    return EngineProc(tmp, weights, engine_id, command=command).start()


@contextlib.contextmanager
def serving(tmp: Path, weights: Path, engine_id: str) -> Iterator[tuple[EngineProc, int]]:
    """A ready engine and its front's pid; stopped at the end."""
    eng = engine(tmp, weights, engine_id)
    try:
        yield eng, eng.wait_ready(90)["front"]["pid"]
    finally:
        eng.stop()


def wait_gone(pid: int, bound: float) -> float:
    t0 = time.monotonic()
    while procs.pid_alive(pid):
        assert time.monotonic() - t0 < bound, f"pid {pid} still alive after {bound} s"
        time.sleep(0.01)
    return time.monotonic() - t0


def long_stream(url: str, lines: list[dict], started: threading.Event, ended: list[str]) -> None:
    stream_lines(url, {"prompt": "a long one", "max_tokens": 100000, "ignore_eos": True}, lines, started, ended)


def stream_lines(url: str, body: dict, lines: list[dict], started: threading.Event, ended: list[str]) -> None:
    """`body` streamed from /generate: each line into `lines` (`started` at the first), then how it ended into
    `ended` ("whole", or the client's error's name)."""
    try:
        with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(json.loads(line))
                started.set()
        ended.append("whole")
    except httpx.HTTPError as e:
        ended.append(type(e).__name__)


def test_the_front_dies_with_a_killed_engine_and_its_streams_are_cut(tmp_path: Path,
                                                                      tiny_weights: Path) -> None:  # noqa: F811
    eng = engine(tmp_path, tiny_weights, "front-a")
    try:
        info = eng.wait_ready(90)
        front = info["front"]["pid"]
        assert procs.pid_alive(front) and info["pid"] != front
        health = httpx.get(eng.url + "/health", timeout=10).json()  # the engine's body, asked over the link
        assert health["ok"] and health["state"] == "ready" and health["engine"]["steps"] >= 0
        assert health["front"]["pid"] == front and health["engine_id"] == "front-a"
        lines: list[dict] = []
        started, ended = threading.Event(), []
        t = threading.Thread(target=long_stream, args=(eng.url, lines, started, ended), daemon=True)
        t.start()
        assert started.wait(30), eng.log()
        eng.child.kill(signal.SIGKILL)
        took = wait_gone(front, DEATH_BOUND_S)
        t.join(10)
        assert ended and ended[0] != "whole" and not any(line.get("done") for line in lines), (ended, lines[-2:])
        assert took < DEATH_BOUND_S
        with pytest.raises(httpx.ConnectError):  # nobody listens on its port any more
            httpx.get(eng.url + "/health", timeout=2)
    finally:
        eng.stop()


def test_a_killed_front_ends_the_engine_as_a_failure(tmp_path: Path, tiny_weights: Path) -> None:  # noqa: F811
    with serving(tmp_path, tiny_weights, "front-b") as (eng, front):
        os.kill(front, signal.SIGKILL)  # the pid this engine started, named in its ready file
        assert eng.child.proc.wait(DEATH_BOUND_S) == 70, eng.log()  # type: ignore[union-attr]
        assert "the HTTP front" in eng.log() and "is gone" in eng.log()


def test_a_stopped_engine_stops_its_front_and_exits_0(tmp_path: Path, tiny_weights: Path) -> None:  # noqa: F811
    with serving(tmp_path, tiny_weights, "front-c") as (eng, front):
        r = httpx.post(eng.url + "/generate", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["completion_tokens"] == 4
        assert eng.child.stop(30) == 0, eng.log()  # SIGTERM to the engine (its group): the front ends with the link
        wait_gone(front, DEATH_BOUND_S)


# ---- pure logic: frames and the front's delivery


def test_frames_round_trip_and_a_broken_frame_is_refused() -> None:
    front = msgspec.msgpack.Decoder(FrontFrame)
    back = msgspec.msgpack.Decoder(EngineFrame)
    sub = Submit(7, "r-7", [1, 2, 3], 16, 0.0, 0, True, 0, 1.5, 2.5)
    data = encode(sub)
    assert front_link.HEADER.unpack(data[:4])[0] == len(data) - 4
    assert front.decode(data[4:]) == sub
    out = Out([[7, 42, 1.0, 2.0, 3.0, 4.0], [7, 43], [7, "length", 3, 2]])
    assert back.decode(encode(out)[4:]) == out
    assert back.decode(encode(Status("ready", "active"))[4:]) == Status("ready", "active")
    with pytest.raises(msgspec.DecodeError):
        front.decode(encode(out)[4:])  # an engine's frame is no front's frame
    with pytest.raises(msgspec.DecodeError):
        back.decode(b"\xc1garbage")


async def test_the_front_delivers_each_item_to_its_requests_sink_and_ends_it_once() -> None:
    state = EngineState("e", "m", "tiny", 64, 8)
    link = front_link.EngineLink(None, 4, state.apply_status)  # type: ignore[arg-type]  # delivery only: no socket
    a, b = Sink(), Sink()
    link.sinks.update({1: a, 2: b})
    link._deliver([[1, 10, 0.1, 0.2, 0.3, 0.4], [2, 20, 0.1, 0.2, 0.3, 0.4], [1, 11], [1, "length", 5, 2],
                   [3, 99], [2, "refused:queue_full", 5, 0]])
    assert await asyncio.wait_for(a.take(), 1) == [("first", (10, 0.1, 0.2, 0.3, 0.4)), ("token", 11),
                                                   ("done", ("length", 5, 2))]
    assert await asyncio.wait_for(b.take(), 1) == [("first", (20, 0.1, 0.2, 0.3, 0.4)),
                                                   ("done", ("refused:queue_full", 5, 0))]
    assert link.sinks == {}  # ended: an item for either later (or for a key it never had) goes nowhere
    link._deliver([[1, 12]])
