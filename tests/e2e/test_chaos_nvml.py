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


# nvidia-ml-py as it loads: its NVMLError_* classes are made at import and set on `sys.modules[__name__]`.
FAKE_REAL_NVML = """
import sys
def _make_errors():
    this = sys.modules[__name__]
    for name in ("NVMLError_Timeout", "NVMLError_GpuIsLost"):
        setattr(this, name, type(name, (Exception,), {"__module__": "pynvml-real"}))
_make_errors()
nvmlEventTypeXidCriticalError = 0x8
nvmlEventTypeDoubleBitEccError = 0x2
def nvmlDeviceGetCount():
    return 3
"""


def test_the_stand_in_loads_a_real_nvml_that_makes_its_error_classes_at_import(tmp_path: Path) -> None:
    """On a GPU machine torch and the agent import `pynvml` with the stand-in first on the path: the real package
    must load as itself (its error classes on it), or every engine dies at `import torch` (the H200 chaos runs'
    cold-start chains, 2026-12-01: AttributeError: module 'pynvml' has no attribute 'NVMLError_Timeout')."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "pynvml.py").write_text(FAKE_REAL_NVML)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(NVML_SHIM_DIR), str(real)])}
    probe = ("import pynvml; print(pynvml.NVMLError_Timeout.__module__, pynvml.NVMLError_GpuIsLost.__module__, "
             "pynvml.nvmlDeviceGetCount(), pynvml.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    real_mod, lost_mod, count, path = out.stdout.split()
    assert (real_mod, lost_mod, count) == ("pynvml-real", "pynvml-real", "3")
    assert Path(path).parent == NVML_SHIM_DIR  # the stand-in is what was imported, the real one behind it


ENTRIES = """
import asyncio, json
from services.agent.nvml import NvmlWatcher

async def main():
    w = NvmlWatcher(lambda gpu, detail: None)
    assert w.start(asyncio.get_running_loop()), "NVML stand-in not picked up"
    print(json.dumps([[e.index, e.uuid] for e in w.entries]), flush=True)
    w.stop()

asyncio.run(main())
"""


def test_the_stand_ins_gpu_is_the_host_backends_gpu_of_that_node(tmp_path: Path) -> None:
    """The agent matches the gpu_manager's GPU records to its own GPUs by UUID (a restarted agent reads which ones
    failed so: services/agent/records.py `load_failed_gpus`). The stand-in's GPU once had another UUID than the host
    backend's: a chaos run's restarted agent ignored the failed GPU's record and started engines on it, each
    refused by the gpu_manager (an `exited` incident a second for ~40 s)."""
    from libs.common.gpu import GpuEntry, resolve_gpu, simulated_gpus

    env = {**os.environ, "PYTHONPATH": str(NVML_SHIM_DIR), "HF_CHAOS_NVML_SOCKET": str(tmp_path / "nvml.sock"),
           "HF_NODE": "node-7"}
    out = subprocess.run([sys.executable, "-c", ENTRIES], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [[index, uuid]] = json.loads(out.stdout)
    [manager_gpu] = simulated_gpus([], "node-7")  # what the gpu_manager's host backend records for that node
    assert (index, uuid) == (manager_gpu.index, manager_gpu.uuid)
    assert resolve_gpu(manager_gpu.uuid, [GpuEntry(index, uuid)]).index == 0
