"""Fixtures for the agent: a real agent process, real engine processes, an event recorder on the bus."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import EngineInfo, EngineSpec, Envelope, NodeInfo
from libs.common.store import Store
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]


def pattern_spec(model: str = "pattern-m", *, replicas: int = 1, standbys: int = 0, env: dict[str, str] | None = None,
                 version: str = "1") -> EngineSpec:
    return EngineSpec(engine_class="pattern", model=model, command=[sys.executable, "-m", "engines.pattern"],
                      env={"HF_PATTERN_HEARTBEAT_S": "0.05", **(env or {})}, replicas=replicas, standbys=standbys,
                      cold_start_s=10.0, version=version)


def crasher_spec() -> EngineSpec:
    """An engine that exits with code 3 as soon as it starts: its spec crash-loops."""
    return EngineSpec(engine_class="crasher", model="crash-m", command=[sys.executable, "-c", "raise SystemExit(3)"],
                      replicas=1, standbys=0, cold_start_s=5.0)


async def start_crash_loop(agent: AgentProcess, store: Store, base_s: float) -> EngineSpec:
    """The agent up with `crasher_spec` only, its backoff from `base_s` (a quick takeover wait: no memory)."""
    spec = crasher_spec()
    agent.start([spec], takeover_wait_s=0.1, crash_backoff_base_s=base_s, crash_backoff_max_s=30,
                crash_backoff_reset_s=30)
    await agent.wait_up(store)
    return spec


class Recorder:
    """Every event on the test's prefix, in arrival order, with waiting helpers."""

    def __init__(self) -> None:
        self.events: list[Envelope] = []
        self._changed = asyncio.Condition()

    async def handler(self, env: Envelope) -> None:
        async with self._changed:
            self.events.append(env)
            self._changed.notify_all()

    def of(self, type_: str, pred: Callable[[Any], bool] = lambda _: True) -> list[Any]:
        return [e.data for e in self.events if e.type == type_ and pred(e.data)]

    async def wait(self, type_: str, pred: Callable[[Any], bool] = lambda _: True, within_s: float = 20.0) -> Any:
        async def found() -> Any:
            async with self._changed:
                while True:
                    hits = self.of(type_, pred)
                    if hits:
                        return hits[0]
                    await self._changed.wait()

        return await asyncio.wait_for(found(), within_s)


@pytest.fixture
async def recorder(bus: Bus) -> AsyncIterator[Recorder]:
    rec = Recorder()
    for subject in ("fault.>", "engine.>"):
        await bus.subscribe(subject, rec.handler)
    yield rec


class AgentProcess:
    def __init__(self, settings: CommonSettings, env: dict[str, str], log_dir: Path) -> None:
        self.settings = settings
        self.env = env
        self.log_dir = log_dir
        self.child: procs.Child | None = None
        self.starts = 0

    def start(self, specs: list[EngineSpec] = (), **overrides: Any) -> AgentProcess:
        env = dict(self.env)
        env.update({"HF_HEARTBEAT_TIMEOUT_S": "1.0", "HF_RECONCILE_INTERVAL_S": "0.2", "HF_NVML": "false",
                    "HF_NODE_TTL_S": "2", "PYTHONPATH": str(ROOT)})
        env.update({f"HF_{k.upper()}": str(v) for k, v in overrides.items()})
        if specs:
            path = self.log_dir / f"engines-{self.starts}.json"
            path.write_text(json.dumps([s.model_dump(mode="json") for s in specs]))
            env["HF_ENGINES_FILE"] = str(path)
        self.starts += 1
        self.child = procs.Child("agent", [sys.executable, "-m", "services.agent"], env=env,
                                 log_path=self.log_dir / "agent.log").start()
        return self

    async def wait_up(self, store: Store) -> NodeInfo:
        """Until this agent process has written its node key (it then serves commands and its socket)."""
        async def mine() -> NodeInfo | None:
            raw = await store.get("nodes/node-1")
            info = NodeInfo.model_validate_json(raw) if raw else None
            return info if info is not None and self.child is not None and info.agent_pid == self.child.pid else None

        return await wait_until(mine)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.child is not None
        self.child.kill(sig)
        self.child.proc.wait(10)  # type: ignore[union-attr]

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


@pytest.fixture
async def agent(settings: CommonSettings, settings_env: dict[str, str], store: Store, tmp_path: Path
                ) -> AsyncIterator[AgentProcess]:
    proc = AgentProcess(settings, settings_env, tmp_path)
    yield proc
    proc.stop()
    # Engines live in their own sessions (they must survive the agent): end every one this test started,
    # found by the agent socket in its environment (an engine spawned as the agent stopped has no record).
    kill_engines_of(str(settings.state_dir / "agent.sock"))
    for line in (tmp_path / "agent.log").read_text(errors="replace").splitlines()[-0:]:
        if "Traceback" in line:
            print((tmp_path / "agent.log").read_text(errors="replace"))
            break


def kill_engines_of(socket_path: str) -> list[int]:
    return procs.kill_pids_with_env("HF_AGENT_SOCKET", socket_path)


async def engine_records(store: Store) -> dict[str, EngineInfo]:
    infos = [EngineInfo.model_validate_json(v) for v in (await store.get_prefix("engines/")).values()]
    return {info.engine_id: info for info in infos}


def alive(pid: int) -> bool:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 0)
        return True
    return False


@pytest.fixture
def gpu_manager(settings_env: dict[str, str]) -> Iterator[Any]:
    """A real gpu_manager on the host backend (memfd memory), in the test's state dir."""
    from tests.gpu_manager.harness import ManagerProc

    env = {**settings_env, "HF_BACKEND": "host", "HF_CHUNK_MIB": "2", "HF_RECONCILE_INTERVAL_S": "0.1"}
    mgr = ManagerProc(env, Path(settings_env["HF_STATE_DIR"])).start()
    yield mgr
    mgr.stop()


TWO_GPUS = json.dumps(["0", "1"])


@pytest.fixture
def two_gpu_manager(settings_env: dict[str, str]) -> Iterator[Any]:
    """A real gpu_manager on the host backend with two simulated GPUs (the agent's `gpus` must be TWO_GPUS), leases
    with a 120 s grace (a reclaim seen in a test is not a deadline's), GPU records rewritten every 0.1 s."""
    from tests.gpu_manager.harness import ManagerProc

    env = {**settings_env, "HF_BACKEND": "host", "HF_CHUNK_MIB": "1", "HF_RECONCILE_INTERVAL_S": "0.1",
           "HF_GPUS": TWO_GPUS, "HF_GRACE_S": "120", "HF_GPU_PUBLISH_INTERVAL_S": "0.1"}
    mgr = ManagerProc(env, Path(settings_env["HF_STATE_DIR"])).start()
    yield mgr
    mgr.stop()


@pytest.fixture
def open_dir() -> Iterator[str]:
    """A directory other users may traverse (pytest's tmp dirs are private to root)."""
    with tempfile.TemporaryDirectory(prefix="hf-agent-uid-", dir="/tmp") as d:
        os.chmod(d, 0o755)
        yield d
