"""A stand-in for nvidia-ml-py on the agent's import path during `holdfast chaos` (never installed elsewhere).

GPU faults are injected where the driver reports them: a datagram `{"gpu": 0, "xid": 79}` (or `"ecc": true`)
sent to the unix socket `$HF_CHAOS_NVML_SOCKET` comes out of `nvmlEventSetWait_v2` as an XID (or double-bit
ECC) event, so the agent's own `NvmlWatcher` -> `GpuHealth.gpu_fault` -> `FaultDetected` path runs unchanged.
Where the real package is installed (a GPU machine) every other call goes to it and its events still come
through; without it there is one device, index 0 (the host backend's one memory pool).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import socket
import sys
from types import ModuleType
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_real() -> ModuleType | None:
    paths = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("pynvml", paths)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    # nvidia-ml-py sets the NVMLError_* classes it makes at import on `sys.modules[__name__]`: while it runs,
    # that name must be the real module, or they land on this stand-in and the real module lacks them.
    shim = sys.modules.get(spec.name)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        if shim is not None:
            sys.modules[spec.name] = shim
    return mod


_REAL = _load_real()


class _Device(tuple):
    """A device handle of this stand-in: ("chaos", index)."""


if _REAL is not None:
    NVMLError_Timeout = _REAL.NVMLError_Timeout
    NVMLError_GpuIsLost = _REAL.NVMLError_GpuIsLost
    nvmlEventTypeXidCriticalError = _REAL.nvmlEventTypeXidCriticalError
    nvmlEventTypeDoubleBitEccError = _REAL.nvmlEventTypeDoubleBitEccError
else:
    class NVMLError_Timeout(Exception):  # type: ignore[no-redef]  # noqa: N801, N818 - the real package's name
        pass

    class NVMLError_GpuIsLost(Exception):  # type: ignore[no-redef]  # noqa: N801, N818 - the real package's name
        pass

    nvmlEventTypeXidCriticalError = 0x8
    nvmlEventTypeDoubleBitEccError = 0x2


class _Memory:
    """nvmlDeviceGetMemoryInfo's answer for the stand-in's device: the host's memory (the host backend's pool)."""

    def __init__(self) -> None:
        self.total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        self.used = self.total - self.free


class _EventData:
    def __init__(self, gpu: int, event_type: int, data: int) -> None:
        self.device = _Device(("chaos", gpu))
        self.eventType = event_type
        self.eventData = data


_sock: socket.socket | None = None


def _injected(timeout_ms: int) -> _EventData | None:
    """The next injected event within `timeout_ms` (0: only one already waiting), else None."""
    global _sock
    path = os.environ.get("HF_CHAOS_NVML_SOCKET")
    if not path:
        return None
    if _sock is None:
        with __import__("contextlib").suppress(FileNotFoundError):
            os.unlink(path)  # a killed agent's socket file
        _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sock.bind(path)
    _sock.settimeout(timeout_ms / 1000.0 if timeout_ms > 0 else 0.0)
    try:
        raw = _sock.recv(4096)
    except (BlockingIOError, TimeoutError):
        return None
    msg = json.loads(raw)
    if msg.get("ecc"):
        return _EventData(int(msg["gpu"]), nvmlEventTypeDoubleBitEccError, 0)
    return _EventData(int(msg["gpu"]), nvmlEventTypeXidCriticalError, int(msg.get("xid", 79)))


def nvmlInit() -> None:
    if _REAL is not None:
        _REAL.nvmlInit()


def nvmlEventSetCreate() -> Any:
    return _REAL.nvmlEventSetCreate() if _REAL is not None else object()


def nvmlDeviceGetCount() -> int:
    return int(_REAL.nvmlDeviceGetCount()) if _REAL is not None else 1


def nvmlDeviceGetHandleByIndex(i: int) -> Any:
    return _REAL.nvmlDeviceGetHandleByIndex(i) if _REAL is not None else _Device(("chaos", i))


def nvmlDeviceGetSupportedEventTypes(handle: Any) -> int:
    if _REAL is not None:
        return int(_REAL.nvmlDeviceGetSupportedEventTypes(handle))
    return nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError


def nvmlDeviceRegisterEvents(handle: Any, mask: int, event_set: Any) -> None:
    if _REAL is not None:
        _REAL.nvmlDeviceRegisterEvents(handle, mask, event_set)


def nvmlDeviceGetIndex(device: Any) -> int:
    if isinstance(device, _Device):
        return int(device[1])
    assert _REAL is not None
    return int(_REAL.nvmlDeviceGetIndex(device))


def nvmlDeviceGetUUID(device: Any) -> str:
    if isinstance(device, _Device):
        # the host backend's UUID of that stand-in GPU (libs/common/gpu.py `simulated_uuid`): the agent matches the
        # gpu_manager's GPU records to its own GPUs by UUID (a restarted agent reads which ones failed so); another
        # UUID here made a restarted agent ignore a failed GPU and start engines on it
        from libs.common.gpu import simulated_uuid

        return simulated_uuid(os.environ.get("HF_NODE", "node-1"), int(device[1]))
    assert _REAL is not None
    return _REAL.nvmlDeviceGetUUID(device)


def nvmlDeviceGetMemoryInfo(device: Any) -> Any:
    if isinstance(device, _Device):
        return _Memory()
    assert _REAL is not None
    return _REAL.nvmlDeviceGetMemoryInfo(device)


def nvmlEventSetWait_v2(event_set: Any, timeout_ms: int) -> Any:
    ev = _injected(0 if _REAL is not None else timeout_ms)
    if ev is not None:
        return ev
    if _REAL is None:
        raise NVMLError_Timeout()
    # the driver's own events still come through; a short wait so an injected one waits at most 100 ms
    return _REAL.nvmlEventSetWait_v2(event_set, min(timeout_ms, 100))


def __getattr__(name: str) -> Any:
    if _REAL is not None:
        return getattr(_REAL, name)
    raise AttributeError(name)
