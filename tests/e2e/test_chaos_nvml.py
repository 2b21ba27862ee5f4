"""A GPU fault injected by chaos comes out of the agent's own NvmlWatcher (services/agent/nvml.py) through the
NVML stand-in (bench/chaos_nvml/pynvml.py), as the driver's XID event would: no side door into the agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.chaos_faults import NVML_SHIM_DIR, send_xid

WATCH = """
import asyncio, json, sys
from services.agent.nvml import NvmlWatcher

async def main():
    seen = asyncio.Queue()
    w = NvmlWatcher(lambda gpu, detail: seen.put_nowait((gpu, detail)))
    assert w.start(asyncio.get_running_loop()), "NVML stand-in not picked up"
    print(json.dumps({"gpus": w.gpus}), flush=True)
    print(json.dumps({"fault": await asyncio.wait_for(seen.get(), 20)}), flush=True)
    w.stop()

asyncio.run(main())
"""


def test_an_injected_xid_reaches_the_agents_nvml_watcher(tmp_path: Path) -> None:
    sock = str(tmp_path / "nvml.sock")
    env = {**os.environ, "PYTHONPATH": str(NVML_SHIM_DIR), "HF_CHAOS_NVML_SOCKET": sock}
    proc = subprocess.Popen([sys.executable, "-c", WATCH], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert 0 in json.loads(proc.stdout.readline())["gpus"]
        deadline = time.monotonic() + 10
        while not Path(sock).exists():  # bound by the watcher's thread on its first wait
            assert time.monotonic() < deadline, "the stand-in never listened"
            time.sleep(0.05)
        send_xid(sock, 0, 79)
        assert json.loads(proc.stdout.readline())["fault"] == [0, "XID 79"]
    finally:
        proc.kill()
        proc.wait()
