"""Fixtures for the router tests: engine processes (the pattern engine: the router's contract with deterministic
tokens, no torch), a router process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from libs.common import procs
from libs.common.store import Store
from tests.engine.support import EngineProc, pattern_engine

# One token per 5 ms: a stream of a few hundred tokens is still in flight when a test kills its engine after
# its first 20 (on a loaded 2-core machine too), and a whole test's generations stay within seconds.
TOKEN_INTERVAL_S = "0.005"


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Callable[[str], EngineProc]]:
    started: list[EngineProc] = []

    def start(engine_id: str) -> EngineProc:
        e = pattern_engine(tmp_path, engine_id, args=("--slots", "4", "--token-interval-s", TOKEN_INTERVAL_S))
        started.append(e.start())
        return e

    yield start
    for e in started:
        e.stop()


class RouterProc:
    def __init__(self, child: procs.Child, port: int) -> None:
        self.child = child
        self.url = f"http://127.0.0.1:{port}"

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=5).json()


@pytest.fixture
def start_router(tmp_path: Path, settings_env: dict[str, str]) -> Iterator[Callable[..., RouterProc]]:
    children: list[procs.Child] = []

    def start(**flags: object) -> RouterProc:
        """A router; anonymous clients allowed unless keys are given (tests/router/test_api_keys.py asks for one);
        one process unless `router_workers` is given (test_workers.py): the tests that watch its table through
        /stats see the one table that serves, whatever the machine's core count would make the default."""
        if not any(k in flags for k in ("api_key", "api_keys", "api_keys_file")):
            flags.setdefault("allow_anonymous", True)
        flags.setdefault("router_workers", 1)
        flags = {k: v for k, v in flags.items() if v is not None}  # None: the setting's own default
        port = procs.free_port()
        argv = ["-m", "services.router", "--router-port", str(port)]
        for k, v in flags.items():
            flag = f"--{k.replace('_', '-')}"
            argv += [flag, str(v).lower() if isinstance(v, bool) else str(v)]
        import sys

        child = procs.Child("router", [sys.executable, *argv], env={**settings_env, "PYTHONUNBUFFERED": "1"},
                            log_path=tmp_path / "router.log").start()
        children.append(child)
        procs.wait_port(port, child, timeout=30)
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "router never became healthy"
            time.sleep(0.05)
        return RouterProc(child, port)

    yield start
    for c in children:
        c.stop()


@dataclass
class OpenAIStack:
    engine: EngineProc
    router: RouterProc


@pytest.fixture
async def openai_stack(engines: Callable[[str], EngineProc], start_router: Callable[..., RouterProc],
                       store: Store) -> OpenAIStack:
    """One engine serving `tiny-ref`, and a router that finds it in etcd at start."""
    engine = engines("oa-a")
    await asyncio.to_thread(engine.wait_ready)
    await store.put("endpoints/tiny-ref/oa-a", engine.url)
    router = await asyncio.to_thread(start_router, hold_timeout_s=2)
    return OpenAIStack(engine, router)
