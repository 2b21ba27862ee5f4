"""GPU health through NVML (nvidia-ml-py, optional): XID errors and uncorrectable (double-bit) ECC errors.

`nvmlEventSetWait` blocks, so it runs in a daemon thread and hands each event to the loop with
`call_soon_threadsafe`. Without NVML (no package, no driver, no GPU) the agent says so once and goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("holdfast.agent.nvml")


class NvmlWatcher:
    def __init__(self, on_fault: Callable[[int, str], None]) -> None:
        self._on_fault = on_fault
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.gpus: list[int] = []
        self.available = False

    def start(self, loop: asyncio.AbstractEventLoop) -> bool:
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - no package, no driver, no GPU: all mean "no NVML here"
            log.warning("NVML unavailable (%s): GPU health (XID, ECC) is not watched on this node", e)
            return False
        try:
            event_set, self.gpus = self._register(pynvml)
        except Exception as e:  # noqa: BLE001 - e.g. events not supported on this device
            log.warning("NVML events unavailable (%s): GPU health is not watched on this node", e)
            return False
        self.available = True
        self._thread = threading.Thread(target=self._run, args=(pynvml, event_set, loop), name="nvml", daemon=True)
        self._thread.start()
        log.info("watching NVML XID and ECC events on GPUs %s", self.gpus)
        return True

    @staticmethod
    def _register(pynvml: Any) -> tuple[Any, list[int]]:
        event_set = pynvml.nvmlEventSetCreate()
        gpus = []
        mask = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            pynvml.nvmlDeviceRegisterEvents(handle, mask & supported, event_set)
            gpus.append(i)
        return event_set, gpus

    def _run(self, pynvml: Any, event_set: Any, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, 500)
            except pynvml.NVMLError_Timeout:
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
