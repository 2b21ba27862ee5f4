"""GPU inventory and health through NVML (nvidia-ml-py, optional): each GPU's index, UUID and memory; XID errors,
uncorrectable (double-bit) ECC errors, and a GPU fallen off the bus (a poll between event waits: a lost GPU sends
no event).

`nvmlEventSetWait` blocks, so it runs in a daemon thread and hands each fault to the loop with
`call_soon_threadsafe`; each GPU's loss is reported once. Without NVML (no package, no driver, no GPU) the agent
says so once and goes on with the configured (simulated) GPUs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from libs.common.gpu import GpuEntry, resolve_gpu

log = logging.getLogger("holdfast.agent.nvml")


class NvmlWatcher:
    def __init__(self, on_fault: Callable[[int, str], None]) -> None:
        self._on_fault = on_fault
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.gpus: list[int] = []
        self.entries: list[GpuEntry] = []
        self._handles: dict[int, Any] = {}
        self._lost: set[int] = set()
        self.available = False

    def start(self, loop: asyncio.AbstractEventLoop) -> bool:
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - no package, no driver, no GPU: all mean "no NVML here"
            log.warning("NVML unavailable (%s): GPU health (XID, ECC) is not watched on this node", e)
            return False
        try:
            event_set = self._register(pynvml)
        except Exception as e:  # noqa: BLE001 - e.g. events not supported on this device
            log.warning("NVML events unavailable (%s): GPU health is not watched on this node", e)
            return False
        self.available = True
        self._thread = threading.Thread(target=self._run, args=(pynvml, event_set, loop), name="nvml", daemon=True)
        self._thread.start()
        log.info("watching NVML XID and ECC events on GPUs %s", self.gpus)
        return True

    def _register(self, pynvml: Any) -> Any:
        event_set = pynvml.nvmlEventSetCreate()
        mask = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            pynvml.nvmlDeviceRegisterEvents(handle, mask & supported, event_set)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            self.entries.append(GpuEntry(i, uuid.decode() if isinstance(uuid, bytes) else str(uuid), total))
            self._handles[i] = handle
            self.gpus.append(i)
        return event_set

    def entries_of(self, selectors: Sequence[int | str]) -> list[GpuEntry]:
        """The configured GPUs (index or UUID) among those NVML sees; all of them when none is configured."""
        if not selectors:
            return list(self.entries)
        return sorted({resolve_gpu(s, self.entries) for s in selectors}, key=lambda g: g.index)

    def _poll_lost(self, pynvml: Any, loop: asyncio.AbstractEventLoop) -> None:
        """A GPU fallen off the bus answers every query with GpuIsLost (and sends no event): reported once."""
        for index, handle in self._handles.items():
            if index in self._lost:
                continue
            try:
                pynvml.nvmlDeviceGetMemoryInfo(handle)
            except pynvml.NVMLError_GpuIsLost:
                self._lost.add(index)
                loop.call_soon_threadsafe(self._on_fault, index, "GPU fallen off the bus (NVML: GPU is lost)")
            except Exception:  # noqa: BLE001 - another query error is not a lost GPU
                continue

    def _run(self, pynvml: Any, event_set: Any, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, 500)
            except pynvml.NVMLError_Timeout:
                self._poll_lost(pynvml, loop)
                continue
            except Exception as e:  # noqa: BLE001 - keep watching; a broken NVML is logged, not fatal
                log.warning("NVML wait failed: %s", e)
                self._stop.wait(1.0)
                continue
            try:
                gpu = int(pynvml.nvmlDeviceGetIndex(data.device))
            except Exception:  # noqa: BLE001
                gpu = -1
            if data.eventType == pynvml.nvmlEventTypeDoubleBitEccError:
                detail = "uncorrectable (double-bit) ECC error"
            else:
                detail = f"XID {data.eventData}"
            loop.call_soon_threadsafe(self._on_fault, gpu, detail)

    def stop(self) -> None:
        self._stop.set()
