"""The chaos run's harder faults, each a function the run calls (bench/chaos.py decides when and keeps count).

- `catch_allocating`: the next engine process to start is stepped (SIGCONT/SIGSTOP slices of ~1 ms) until it
  holds a lease the gpu_manager reports uncommitted, then SIGKILLed there: a death during start-up allocation.
- `send_xid`: a GPU fault injected where NVML reports it (bench/chaos_nvml/pynvml.py on the agent's path).
- `pressure`: bench/chaos_pressure.py, a hostile same-uid client of the gpu_manager, as a process of its own.
- `api_load`: large bodies POSTed to the controller's admin endpoints, with and without the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from libs.common import procs

MEMFD_MAP = re.compile(r"/memfd:hf-([\w-]+)-\d+")
NVML_SHIM_DIR = Path(__file__).with_name("chaos_nvml")


def writable_leases(pid: int) -> set[str]:
    """Leases the process maps writable (host backend)."""
    return memfd_leases(pid)[1]


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return "X"


class EngineScan:
    """The engine processes of one stack (environment `HF_STATE_DIR=<state_dir>` and `HF_ENGINE_ID`), found by
    reading /proc/<pid>/environ of new processes only: a pid found to be an engine stays one (with its model)
    until it is gone; one that is not is read again after `recheck_s` (a process forked by the agent shows the
    agent's environment until its exec, ms later). A full read of every process's environment, 20 times a
    second for the mapping samples and every ms or two while an allocation is caught, took a good share of
    a 2-core machine from the stack it measures."""

    def __init__(self, state_dir: Path, recheck_s: float = 0.25) -> None:
        self.mark = f"HF_STATE_DIR={state_dir}".encode()
        self.recheck_s = recheck_s
        self.engines: dict[int, str] = {}  # pid -> model
        self.others: dict[int, float] = {}  # pid -> when found not to be an engine

    def scan(self, model: str | None = None) -> set[int]:
        """The live engine pids (of `model`, when given)."""
        now = time.monotonic()
        me = os.getpid()
        present = {int(n) for n in os.listdir("/proc") if n.isdigit()} - {me}
        for gone in set(self.engines) - present:
            del self.engines[gone]
        for gone in set(self.others) - present:
            del self.others[gone]
        for pid in present - set(self.engines):
            if now - self.others.get(pid, float("-inf")) < self.recheck_s:
                continue
            found = self._model_of(pid)
            if found is None:
                self.others[pid] = now
            else:
                self.engines[pid] = found
                self.others.pop(pid, None)
        return {pid for pid, m in self.engines.items() if model is None or m == model}

    def _model_of(self, pid: int) -> str | None:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            return None
        if self.mark not in env or not any(e.startswith(b"HF_ENGINE_ID=") for e in env):
            return None
        return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"HF_MODEL=")), "")


def engine_pids(state_dir: Path) -> set[int]:
    return set(procs.pids_with_env("HF_STATE_DIR", str(state_dir), having=("HF_ENGINE_ID",)))


def _stop(pid: int) -> bool:
    """SIGSTOP and wait until every thread is stopped; False when the process is gone."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        st = proc_state(pid)
        if st in ("T", "t"):
            return True
        if st in ("X", "Z"):
            return False
        time.sleep(0.0005)
    return proc_state(pid) in ("T", "t")


def memfd_leases(pid: int) -> tuple[set[str], set[str]]:
    """(every lease the process maps, the ones it maps writable): memfd names in /proc/<pid>/maps (host)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set(), set()
    every, writable = set(), set()
    for line in maps.splitlines():
        m = MEMFD_MAP.search(line)
        if m is not None:
            every.add(m.group(1))
            if line.split()[1][1] == "w":  # perms: r w x s/p
                writable.add(m.group(1))
    return every, writable


def engine_id_of(pid: int) -> str | None:
    """The engine id a process was started as (HF_ENGINE_ID in its environment), None if unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"HF_ENGINE_ID=")), None)


def catch_allocating(scan: Callable[[], set[int]], before: set[int], leases_of: Callable[[int], dict[str, str | None]],
                     within_s: float = 60.0, slice_s: float = 0.001) -> dict[str, Any]:
    """Wait for an engine process (of those `scan()` finds) not in `before`; let it run until the gpu_manager
    grants it its first lease, then step it (SIGCONT/SIGSTOP slices of ~1 ms) until it holds a lease the
    gpu_manager reports uncommitted, and SIGKILL it there. `leases_of(pid)`: the leases the gpu_manager has
    granted that process's engine, each with its tag while uncommitted (None once committed). Asked of the
    gpu_manager, not read from /proc/<pid>/maps: a CUDA lease is mapped in device memory, where the process's
    maps do not show it. Blocking: run it in a thread. Stepping only from the first grant on keeps its
    heartbeats flowing through the rest of its start-up.

    Returns {"result": "hit", "tag": ...} or {"result": "missed"} (every lease it was granted was committed
    before a stop landed between grant and commit: it is SIGKILLed anyway, a death early in its life) or
    {"result": "no start-up"}."""
    deadline = time.monotonic() + within_s
    pid = None
    while pid is None and time.monotonic() < deadline:
        new = scan() - before
        pid = min(new) if new else None
        time.sleep(0.002)
    if pid is None:
        return {"result": "no start-up"}
    while time.monotonic() < deadline and not leases_of(pid):
        if proc_state(pid) in ("X", "Z"):
            return {"result": "no start-up", "pid": pid}
        time.sleep(0.001)
    checked: set[str] = set()
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        if not _stop(pid):
            return {"result": "no start-up", "pid": pid}
        held = leases_of(pid)
        for lease, tag in sorted(held.items()):
            if tag is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                return {"result": "hit", "tag": tag, "pid": pid, "lease": lease}
        fresh = set(held) - checked
        checked |= fresh
        if checked and not fresh:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 1.0:  # its allocations are done and committed
                break
        elif fresh:
            quiet_since = None
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return {"result": "no start-up", "pid": pid}
        time.sleep(slice_s)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return {"result": "missed", "pid": pid}


def send_xid(socket_path: str, gpu: int, xid: int) -> None:
    """One XID event into the agent's NVML stand-in (raises OSError when no agent listens)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(json.dumps({"gpu": gpu, "xid": xid}).encode(), socket_path)


async def pressure(socket_path: str, on_holding: Callable[[], Any], *, connections: int = 200,
                   hold_s: float = 60.0) -> dict[str, Any]:
    """Run the hostile client; `on_holding()` is awaited once its pressure is up, and the pressure is let go
    when it returns (or after `hold_s` at most). Its report, or why none."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.chaos_pressure", "--socket", socket_path, "--connections", str(connections),
        "--hold", str(hold_s), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stdin is not None
    report: dict[str, Any] = {}
    try:
        async with asyncio.timeout(hold_s + 90):
            while line := await proc.stdout.readline():
                obj = json.loads(line)
                if obj.get("holding"):
                    await on_holding()
                    with contextlib.suppress(OSError):
                        proc.stdin.write(b"release\n")
                        await proc.stdin.drain()
                else:
                    report = obj
            await proc.wait()
    except TimeoutError:
        report = {"error": "the pressure client did not finish"}
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return report or {"error": f"no report (exit {proc.returncode})"}


# (method, path, token?) of admin endpoints; the bodies are far past any sane size, and the authenticated
# ones name nothing that exists, so none of them may change the cluster whatever the controller does.
API_TARGETS = (
    ("POST", "/v1/nodes/{node}/drain", False),
    ("POST", "/v1/engine-classes/reference/upgrade", False),
    ("POST", "/v1/engines/chaos-no-such-engine/failover", True),
)


async def post_raw(url: str, path: str, body: bytes, token: str | None) -> str:
    """POST `body` and return the status the server answered, read even when it answers early (before the
    body is sent) and closes: 'error:<why>' only when no status line came back at all."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            + (f"Authorization: Bearer {token}\r\n" if token else "") + "\r\n")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError as e:
        return f"error:{type(e).__name__}"
    try:
        writer.write(head.encode())
        with contextlib.suppress(OSError):  # refused early: the answer may already wait to be read
            for i in range(0, len(body), 1 << 20):
                writer.write(body[i:i + (1 << 20)])
                await writer.drain()
        try:
            line = await asyncio.wait_for(reader.readline(), 30)
        except (OSError, TimeoutError) as e:
            return f"error:{type(e).__name__}"
        parts = line.split()
        return parts[1].decode() if len(parts) > 1 and parts[0].startswith(b"HTTP/") else "error:no status line"
    finally:
        writer.close()


async def api_load(api_url: str, token: str, node: str, stop: asyncio.Event, *, body_mib: int = 8,
                   loops_per_target: int = 1, statuses: Counter[str] | None = None) -> Counter[str]:
    """POST `body_mib` MiB JSON bodies to each target in a loop until `stop`; the statuses answered
    ('401', '413', ... or 'error:<why>'), counted into `statuses` as they come when given."""
    statuses = Counter() if statuses is None else statuses
    body = b'{"successor": "' + b"x" * (body_mib << 20) + b'", "version": "v"}'

    async def loop(path: str, auth: bool) -> None:
        while not stop.is_set():
            status = await post_raw(api_url, path.format(node=node), body, token if auth else None)
            statuses[f"{'auth' if auth else 'anon'}:{status}"] += 1
            if status.startswith("error"):
                await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(loop(p, a)) for _, p, a in API_TARGETS for _ in range(loops_per_target)]
    await asyncio.gather(*tasks, return_exceptions=True)
    return statuses
