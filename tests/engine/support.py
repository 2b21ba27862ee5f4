"""Helpers for tests that run real engine processes: the reference engine (tiny size, torch) or the pattern engine
(engines/pattern with `--agent off`: the router's contract with deterministic tokens, no torch)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from libs.common import procs

ENGINE = [sys.executable, "-m", "engines.reference"]
PATTERN = [sys.executable, "-m", "engines.pattern", "--agent", "off"]


def make_tiny_weights(path: Path, seed: int = 0) -> Path:
    from engines.reference.config import get_config
    from engines.reference.weights import make_weights

    return make_weights(get_config("tiny"), path, seed=seed)


class EngineProc:
    """`python -m engines.reference serve` (or `command`: another engine taking `--id` and `--ready-file`) as a
    child process; `url` once its ready file exists."""

    def __init__(self, tmp: Path, weights: Path | None, engine_id: str, *, env: dict[str, str] | None = None,
                 args: tuple[str, ...] = (), command: list[str] | None = None) -> None:
        self.engine_id = engine_id
        self.ready_file = tmp / f"{engine_id}.ready.json"
        self.ready_file.unlink(missing_ok=True)
        base = command if command is not None else [*ENGINE, "serve", "--size", "tiny", "--weights", str(weights)]
        argv = [*base, "--id", engine_id, "--ready-file", str(self.ready_file), *args]
        self.child = procs.Child(engine_id, argv, env={"PYTHONUNBUFFERED": "1", **(env or {})},
                                 log_path=tmp / f"{engine_id}.log")
        self.info: dict = {}

    def start(self) -> EngineProc:
        self.child.start()
        return self

    def wait_ready(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return self.info
            if not self.child.alive():
                raise RuntimeError(f"engine {self.engine_id} exited: {self.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"engine {self.engine_id} not ready after {timeout}s: {self.log()}")

    @property
    def url(self) -> str:
        return str(self.info["endpoint"])

    def log(self) -> str:
        p = self.child.log_path
        return p.read_text(errors="replace")[-3000:] if p and p.exists() else ""

    def stop(self) -> None:
        self.child.stop()


def pattern_engine(tmp: Path, engine_id: str, *, args: tuple[str, ...] = ()) -> EngineProc:
    """The pattern engine serving alone (no agent, no memory), not started yet."""
    return EngineProc(tmp, None, engine_id, args=args, command=PATTERN)


def generate(url: str, **body: object) -> dict:
    r = httpx.post(url + "/generate", json={"stream": False, **body}, timeout=60)
    r.raise_for_status()
    return r.json()


@contextlib.contextmanager
def in_flight(url: str, n: int, **body: object) -> Iterator[list[int]]:
    """A streamed generation's first `n` tokens, its stream still open inside the block (the request in flight
    when its engine dies there)."""
    sent: list[int] = []
    with httpx.Client(timeout=30) as client, client.stream("POST", url + "/generate",
                                                           json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            sent.append(json.loads(line)["token"])
            if len(sent) == n:
                break
        yield sent
