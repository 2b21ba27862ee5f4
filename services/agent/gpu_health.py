"""The node's GPUs and their health: which GPUs there are (NVML's, or the configured simulated ones), which are
unhealthy (no engine is placed there: gpus.py), and what a GPU's failure does (a MarkGpu, or an NVML event: every
live engine on it gets its one `gpu_fault` and is killed, and the gpu_manager is told until it answers,
gpu_reports.py, invariant 12).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from libs.common.bus import Bus
from libs.common.events import EngineRole, FaultKind, MarkGpu, MarkGpuReply, SetGpuHealth, SetGpuHealthReply
from libs.common.gpu import GpuEntry, resolve_gpu, simulated_gpus
from services.agent.engines import EngineRecord
from services.agent.gpu_reports import GpuReports
from services.agent.gpu_wishes import WISHES_FILE, GpuWishes
from services.agent.pidfd import ExitStatus
from services.agent.table import EngineTable, FaultReporter

log = logging.getLogger("holdfast.agent")
REPORT_WAIT_S = 5.0  # how long a MarkGpu waits for the gpu_manager's answer (the report goes on after)


class Host(EngineTable, FaultReporter, Protocol):
    """What GPU health needs of the agent beyond its engine table and faulting: the bus (the gpu_manager is told),
    killing and retiring an engine, and a reconcile pass."""

    bus: Bus

    async def kill_confirmed(self, rec: EngineRecord, within_s: float = 5.0) -> ExitStatus | None: ...

    def retire(self, rec: EngineRecord) -> None: ...

    def reconcile_soon(self) -> None: ...


class GpuHealth:
    def __init__(self, host: Host) -> None:
        self.host = host
        settings = host.settings
        # The node's GPUs (NVML's, or the host backend's simulated list: app.py sets them) and the unhealthy ones.
        self.gpus: list[GpuEntry] = simulated_gpus(settings.gpus, settings.node)
        self.unhealthy: dict[int, str] = {}
        # told to the gpu_manager until it answers, even across this agent's death (kept in the state dir by UUID)
        wishes = GpuWishes(settings.state_dir / WISHES_FILE, lambda gpu: resolve_gpu(gpu, self.gpus).uuid)
        self.reports = GpuReports(self._send_gpu_health, wishes)

    def uuid_of(self, gpu: int) -> str | None:
        return next((g.uuid for g in self.gpus if g.index == gpu), None)

    def resume(self) -> None:
        """Health a previous agent wished and the manager never answered: newer than the manager's marks (already
        in `unhealthy`), so it counts here and is sent again."""
        for gpu, (healthy, detail) in self.reports.resume(self.gpus).items():
            if healthy:
                self.unhealthy.pop(gpu, None)
            else:
                self.unhealthy[gpu] = detail

    def gpu_fault(self, gpu: int, detail: str) -> list[str]:
        """A GPU failed (NVML, or marked): it takes no engine until marked healthy; every live engine on it gets its
        one `gpu_fault` (the controller sends its incident to the cold-start fallback: the memory is lost) and is
        killed (it cannot serve from lost memory, and its slot is the fallback's); the gpu_manager is told, so that
        it reclaims the GPU's leases and placement avoids it (`report_gpu`)."""
        self.unhealthy[gpu] = detail or "unhealthy"
        hit = [r for r in self.host.records() if gpu in r.gpus and r.live]  # a TP group: any rank's GPU
        for rec in hit:
            if self.host.fault(rec, FaultKind.GPU_FAULT, detail=detail, died_at=time.time()):
                self.host.background(self._kill_faulted(rec), f"gpu-fault-kill:{rec.engine_id}")
        return [r.engine_id for r in hit]

    def gpu_healthy(self, gpu: int) -> None:
        self.unhealthy.pop(gpu, None)
        self.host.reconcile_soon()

    async def _kill_faulted(self, rec: EngineRecord) -> None:
        try:
            await self.host.kill_confirmed(rec)
        except TimeoutError:
            log.error("engine %s on a failed GPU did not die within 5 s of its SIGKILL", rec.engine_id)
        if rec.role is EngineRole.STANDBY:
            self.host.retire(rec)  # holds no memory: replaced at once (on a healthy GPU)
            self.host.reconcile_soon()

    async def mark_gpu(self, cmd: MarkGpu) -> MarkGpuReply:
        """The MarkGpu command, and what an NVML fault does (`nvml_fault`)."""
        gpu = resolve_gpu(cmd.gpu, self.gpus)
        engines = self.gpu_fault(gpu.index, cmd.detail) if not cmd.healthy else []
        if cmd.healthy:
            self.gpu_healthy(gpu.index)
        told = await self.report_gpu(gpu.index, cmd.healthy, cmd.detail)
        return MarkGpuReply(gpu=gpu.index, uuid=gpu.uuid, healthy=cmd.healthy, engines=engines, gpu_manager=told)

    def nvml_fault(self, gpu: int, detail: str) -> None:
        """From the NVML thread (through the loop): the faults are published in this call, the gpu_manager told next."""
        if gpu < 0:
            log.error("NVML fault on an unknown device: %s", detail)
            return
        self.gpu_fault(gpu, detail)
        self.reports.want(gpu, False, detail)

    async def report_gpu(self, gpu: int, healthy: bool, detail: str) -> SetGpuHealthReply | None:
        """Tell the node's gpu_manager, and wait up to REPORT_WAIT_S for its answer; None when it has not answered
        by then (it is told as soon as it is back: gpu_reports.py). The fault stands here anyway."""
        told = self.reports.want(gpu, healthy, detail)
        try:
            async with asyncio.timeout(REPORT_WAIT_S):
                return await asyncio.shield(told)
        except TimeoutError:
            return None

    async def _send_gpu_health(self, gpu: int, healthy: bool, detail: str) -> SetGpuHealthReply:
        return await self.host.bus.request(self.host.node, SetGpuHealth(gpu=gpu, healthy=healthy, detail=detail),
                                           SetGpuHealthReply, timeout=REPORT_WAIT_S)

    def close(self) -> None:
        self.reports.close()
