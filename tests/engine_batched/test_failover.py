"""The batched engine through a SIGKILL with 16 streams in flight (real gpu_manager on the host backend, real
processes, real signals): the successor adopts the KV lease and the journal, continues every sequence with no
prefill recomputed, and each stream, resumed the way the router resumes it, ends with exactly the tokens of an
uninterrupted run (deterministic mode)."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import Freeze, FreezeReply
from tests.engine.conftest import gpu_manager, tiny_weights  # noqa: F401 - fixtures

STREAMS = 16
MAX_TOKENS = 256  # 160 once let 2 of 16 streams end before the kill on a loaded CI machine
ARGS = ("--size", "tiny", "--memory", "leased", "--deterministic", "--max-num-seqs", "32",
        "--max-num-batched-tokens", "256", "--prefill-chunk", "32", "--block-size", "16")


class BatchedEngine:
    def __init__(self, tmp: Path, weights: Path, engine_id: str, env: dict[str, str], *extra: str) -> None:
        self.ready = tmp / f"{engine_id}-{time.monotonic_ns()}.ready.json"
        argv = [sys.executable, "-m", "engines.batched", "--weights", str(weights), "--id", engine_id,
                "--ready-file", str(self.ready), *ARGS, *extra]
        self.child = procs.Child(engine_id, argv, env={**env, "PYTHONUNBUFFERED": "1"},
                                 log_path=tmp / f"{engine_id}.log").start()

    def wait_ready(self, timeout: float = 90.0) -> dict:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            assert self.child.alive(), self.log()
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.05)
        self.info = json.loads(self.ready.read_text())
        return self.info

    @property
    def url(self) -> str:
        return str(self.info["endpoint"])

    def log(self) -> str:
        p = self.child.log_path
        return p.read_text(errors="replace")[-4000:] if p and p.exists() else ""

    def kill(self) -> None:
        self.child.kill(signal.SIGKILL)
        self.child.proc.wait(10)  # type: ignore[union-attr]


def body(i: int, **kw: object) -> dict:
    return {"prompt": f"stream {i}: the cache outlives the engine " + "x" * (i * 3), "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "request_id": f"req-{i}", **kw}


def alone(url: str, i: int) -> list[int]:
    r = httpx.post(url + "/generate", json=body(i, request_id=f"solo-{i}"), timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def stream_until_killed(url: str, i: int, seen: list[int], started: threading.Event,
                        together: threading.Barrier | None = None) -> None:
    """Stream request `i` into `seen` until it ends or the engine dies; `together`: sent once every stream's thread is
    ready to send (a stream sent seconds before the last on a loaded machine could end before the kill)."""
    if together is not None:
        together.wait(60)
    try:
        with httpx.stream("POST", url + "/generate", json=body(i, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                obj = json.loads(line)
                if "token" in obj:
                    seen.append(obj["token"])
                    started.set()
    except httpx.HTTPError:
        pass  # the engine died under the stream


def uninterrupted(url: str) -> dict[int, list[int]]:
    """Every stream's tokens of an uninterrupted run, the requests sent together (deterministic mode: together as
    alone; tests/engine_batched/test_server.py checks it)."""
    with ThreadPoolExecutor(STREAMS) as ex:
        return dict(enumerate(ex.map(lambda i: alone(url, i), range(STREAMS))))


def resume(url: str, i: int, seen: list[int]) -> list[int]:
    """What the router sends after a failure: the prompt, the tokens the client has, what is left."""
    r = httpx.post(url + "/generate", json=body(i, resume=seen, max_tokens=MAX_TOKENS - len(seen)), timeout=60)
    r.raise_for_status()
    return seen + r.json()["tokens"]


def streams_started(engine: BatchedEngine, streams: int) -> tuple[dict[int, list[int]], list[threading.Thread]]:
    """`streams` streams under way on `engine`, each past its first token: the tokens each client sees, and the
    threads reading them (they end when the engine dies)."""
    seen: dict[int, list[int]] = {i: [] for i in range(streams)}
    events = [threading.Event() for _ in range(streams)]
    together = threading.Barrier(streams)
    threads = [threading.Thread(target=stream_until_killed, args=(engine.url, i, seen[i], events[i], together),
                                daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(60), engine.log()
    return seen, threads


def run_kill_and_resume(first: BatchedEngine, start_successor) -> tuple[dict, dict[int, list[int]], dict[int, list[int]]]:
    expected = uninterrupted(first.url)
    seen, threads = streams_started(first, STREAMS)
    time.sleep(0.05)
    first.kill()
    for t in threads:
        t.join(10)
    successor: BatchedEngine = start_successor()
    info = successor.wait_ready()
    try:
        got = {i: resume(successor.url, i, list(seen[i])) for i in range(STREAMS)}
        health = httpx.get(successor.url + "/health", timeout=10).json()
    finally:
        successor.child.stop()
    return {"info": info, "health": health}, expected, got


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sixteen_streams_continue_exactly_after_a_sigkill_with_no_prefill_recomputed(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str]) -> None:  # noqa: F811
    first = BatchedEngine(tmp_path, tiny_weights, "bat-1", settings_env, "--num-blocks", "512")
    first.wait_ready()
    # the successor would size a new cache otherwise (as on a GPU, from its free memory): it keeps the lease's
    out, expected, got = run_kill_and_resume(first, lambda: BatchedEngine(tmp_path, tiny_weights, "bat-1", settings_env,
                                                                          "--num-blocks", "300"))
    rec, stats = out["info"]["recovery"], out["health"]["engine"]
    assert rec["source"] == "reattached" and rec["journal"] == "adopted"
    assert out["info"]["memory"]["num_blocks"] == 512
    in_flight = rec["adopted"]
    assert in_flight == STREAMS and rec["dropped"] == 0, rec  # every stream was mid-generation
    assert got == expected  # every stream, token for token
    assert stats["claimed"] == in_flight and stats["prefill_tokens"] == 0 and stats["claim_extra_tokens"] == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_cold_spawned_successor_takes_the_kv_lease_and_journal_over_with_the_transfer_token(
        tmp_path: Path, tiny_weights: Path, gpu_manager: Path, settings_env: dict[str, str],  # noqa: F811
        settings: CommonSettings, bus: Bus) -> None:
    first = BatchedEngine(tmp_path, tiny_weights, "bat-a", settings_env)
    first.wait_ready()
    token: list[str] = []

    def successor() -> BatchedEngine:
        import asyncio

        fut = asyncio.run_coroutine_threadsafe(bus.request(settings.node, Freeze(owner="bat-a"), FreezeReply), loop)
        frozen = fut.result(30)
        token.append(frozen.transfer_token)
        tiny_weights.rename(tiny_weights.with_suffix(".gone"))  # leases only: no file to fall back on
        return BatchedEngine(tmp_path, tiny_weights, "bat-b", {**settings_env, "HF_TAKEOVER_FROM": "bat-a",
                                                               "HF_TRANSFER_TOKEN": frozen.transfer_token})

    import asyncio

    loop = asyncio.get_running_loop()
    out, expected, got = await asyncio.to_thread(run_kill_and_resume, first, successor)
    rec, stats = out["info"]["recovery"], out["health"]["engine"]
    assert rec["source"] == "takeover" and rec["journal"] == "adopted" and rec["adopted"] >= 1
    assert got == expected
    assert stats["prefill_tokens"] == 0
