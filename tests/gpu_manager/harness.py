"""Test harness: a real gpu_manager process (and its keeper), and real engine processes on the SDK."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from libs.common import procs

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ManagerProc:
    env: dict[str, str]
    state_dir: Path
    child: procs.Child | None = None
    starts: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def socket(self) -> str:
        return self.env.get("HF_GPU_MANAGER_SOCKET") or str(self.state_dir / "gpu_manager.sock")

    @property
    def keeper_socket(self) -> str:
        return str(self.state_dir / "gpu_keeper.sock")

    def start(self) -> ManagerProc:
        self.starts += 1
        self.child = procs.Child(
            "gpu_manager", [sys.executable, "-m", "services.gpu_manager"], env={**self.env, **self.extra},
            log_path=self.state_dir.parent / f"gpu_manager.{self.starts}.log",
        ).start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not self.child.alive():
                raise RuntimeError(f"gpu_manager exited: {self.log()}")
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.connect(self.socket)
                return self
            time.sleep(0.05)
        raise TimeoutError(f"gpu_manager did not listen: {self.log()}")

    def log(self) -> str:
        path = self.state_dir.parent / f"gpu_manager.{self.starts}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.child is not None
        return self.child.pid

    def kill(self) -> None:
        assert self.child is not None
        self.child.kill(signal.SIGKILL)
        self.child.proc.wait(10)  # type: ignore[union-attr]

    def keeper_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(Path(self.keeper_socket + ".pid").read_text())
        return None

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
        pid = self.keeper_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def fd_targets(pid: int) -> list[str]:
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
    return out


def holds_lease_memory(pid: int, lease_id: str) -> bool:
    """Whether a process holds an fd of the lease's memfds (named hf-<lease id>-<chunk>)."""
    return any(f"hf-{lease_id}-" in t for t in fd_targets(pid))


class Engine:
    """An engine process (tests/gpu_manager/engine_main.py) driven over stdin/stdout, one JSON line each."""

    def __init__(self, socket_path: str, engine_id: str, *args: str, backend: str = "host") -> None:
        env = {**os.environ, "HF_GPU_MANAGER_SOCKET": socket_path, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu_manager.engine_main", engine_id, backend, *args], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def ask(self, command: str, timeout: float = 60) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"engine exited ({self.proc.wait(timeout)}): {err[-3000:]}")
        return json.loads(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def as_other_uid(uid: int, fn) -> dict:  # noqa: ANN001
    """Run `fn()` (returning a JSON-able dict) in a forked child that switched to `uid` first.

    Forked rather than exec'd: the test's interpreter may live where another user cannot execute it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 0
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            out = fn()
        except BaseException as e:  # noqa: BLE001
            out, code = {"code": "exception", "message": repr(e)}, 1
        os.write(w, json.dumps(out).encode())
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


async def until(fn, timeout: float = 30.0):  # noqa: ANN001
    """Poll another process's state (an async or plain callable) until truthy, from a test's event loop;
    waiting, not timing."""
    import asyncio

    for _ in range(int(timeout / 0.05)):
        value = fn()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout}s")


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05):  # noqa: ANN001
    """Poll until `predicate()` is truthy (returns it) or fail; for waiting on other processes, not timing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")
