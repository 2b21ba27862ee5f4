"""The agent's reports of GPU health to its node's gpu_manager (`SetGpuHealth`), level-triggered: per GPU the agent
keeps the health it wants the manager to hold, and one task per GPU sends the latest wish until the manager answers.

Why: a report sent once was lost when the manager was restarting or the request timed out, and the failed GPU's
leases then waited out their grace period (seconds to minutes) instead of being reclaimed at once. The manager's
mark is idempotent and durable (services/gpu_manager invariant 16), so sending it again is harmless, and a wish it
answered needs no re-sending, even after it restarts.

Invariants:
1. Per GPU at most one report is in flight; wishes reach the manager in the order they were made, and the latest is
   sent until answered (a newer wish replaces an older one not yet answered: only the latest level matters).
2. A report without an answer (no responder: the manager is restarting; a timeout; a broken connection) or with a
   temporary error is sent again after a `Backoff` delay (libs/common/backoff.py), capped at `RETRY_MAX_S`; a
   permanent refusal (the manager has no such GPU, or may not be told) is logged and not retried.
3. Each wish's future is resolved once, with the answer to it or to a later wish of the same GPU (None: refused for
   good), never with an exception: nobody has to wait on it.
4. With `wishes` (gpu_wishes.py), a wish is durable before it is first sent and removed once answered or refused for
   good, so one the manager never answered outlives the agent; `resume()` sends what a previous agent left. A state
   dir that refuses the write (disk full, read-only) does not hold the wish back: it is sent anyway (a failed GPU's
   leases reclaimed now matter more than the wish outliving this agent), and written again at each retry until
   the disk takes it or the manager answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from libs.common.backoff import Backoff
from libs.common.errors import NotFound, RemoteError
from libs.common.events import SetGpuHealthReply
from libs.common.gpu import GpuEntry, resolve_gpu
from services.agent.gpu_wishes import GpuWishes

log = logging.getLogger("holdfast.agent.gpu_reports")

RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0  # a restarted manager hears of the fault within this of its return
TEMPORARY_CODES = frozenset({"internal", "unavailable", "timeout"})  # the manager's own errors worth a retry

Send = Callable[[int, bool, str], Awaitable[SetGpuHealthReply]]
Wish = tuple[int, bool, str]  # (sequence number, healthy, detail)


def retried(error: Exception) -> bool:
    """Whether a report that failed so is sent again: yes unless the manager refused it for good."""
    return not isinstance(error, RemoteError) or error.remote_code in TEMPORARY_CODES


class GpuReports:
    def __init__(self, send: Send, wishes: GpuWishes | None = None) -> None:
        self._send = send
        self._durable = wishes
        self._seq = 0
        self._wanted: dict[int, Wish] = {}
        self._waiters: dict[int, list[tuple[int, asyncio.Future[SetGpuHealthReply | None]]]] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def want(self, gpu: int, healthy: bool, detail: str) -> asyncio.Future[SetGpuHealthReply | None]:
        """The manager is to hold GPU `gpu` as `healthy`; the future: its answer (invariant 3)."""
        loop = asyncio.get_running_loop()
        self._seq += 1
        self._wanted[gpu] = (self._seq, healthy, detail)
        if self._durable is not None:
            self._durable.put(gpu, healthy, detail)  # before any send (invariant 4)
        done: asyncio.Future[SetGpuHealthReply | None] = loop.create_future()
        self._waiters.setdefault(gpu, []).append((self._seq, done))
        if gpu not in self._tasks:
            task = loop.create_task(self._report(gpu), name=f"report-gpu:{gpu}")
            self._tasks[gpu] = task
            task.add_done_callback(self._task_done)
        return done

    def resume(self, gpus: Sequence[GpuEntry]) -> dict[int, tuple[bool, str]]:
        """Send again what a previous agent wished and the manager never answered (invariant 4); returns it by GPU
        index, {gpu: (healthy, detail)}, for the caller to hold as its own view. A wish for a GPU not among `gpus`
        is logged and dropped."""
        if self._durable is None:
            return {}
        resumed: dict[int, tuple[bool, str]] = {}
        for name, (healthy, detail) in self._durable.load().items():
            try:
                gpu = resolve_gpu(name, gpus).index
            except NotFound as e:
                log.error("a previous agent's wish that GPU %s be %s is dropped: %s", name, _health(healthy), e)
                self._durable.forget(name)
                continue
            log.warning("telling the gpu_manager again that GPU %d is %s (%s): a previous agent's wish it never "
                        "answered", gpu, _health(healthy), detail)
            self.want(gpu, healthy, detail)
            resumed[gpu] = (healthy, detail)
        return resumed

    def pending(self) -> dict[int, bool]:
        """GPUs whose latest wish the manager has not answered yet, with the health wished."""
        return {gpu: self._wanted[gpu][1] for gpu in self._tasks}

    async def _report(self, gpu: int) -> None:
        backoff = Backoff(first_s=RETRY_FIRST_S, max_s=RETRY_MAX_S, jitter=0.2)
        while True:
            seq, healthy, detail = self._wanted[gpu]
            if self._durable is not None and self._durable.unsaved:
                self._durable.save()  # refused before (invariant 4): again, while the manager is not told
            try:
                reply: SetGpuHealthReply | None = await self._send(gpu, healthy, detail)
            except Exception as e:  # noqa: BLE001 - every failure is an outcome: retried or given up (invariant 2)
                if retried(e):
                    if backoff.failures == 0:
                        log.warning("gpu_manager not told yet that GPU %d is %s (%s); retrying until it answers",
                                    gpu, _health(healthy), e)
                    await asyncio.sleep(backoff.next_delay())
                    continue
                log.error("gpu_manager refused that GPU %d is %s: %s; not retried", gpu, _health(healthy), e)
                reply = None
            if backoff.failures:
                log.info("gpu_manager told that GPU %d is %s after %d failed tries", gpu, _health(healthy),
                         backoff.failures)
            self._settle(gpu, seq, reply)
            if self._wanted[gpu][0] == seq:  # nothing newer wished meanwhile: done (no await from here on)
                del self._tasks[gpu]
                if self._durable is not None:
                    self._durable.drop(gpu)
                return
            backoff.reset()

    def _settle(self, gpu: int, seq: int, reply: SetGpuHealthReply | None) -> None:
        keep = []
        for wished, fut in self._waiters.get(gpu, []):
            if wished > seq:
                keep.append((wished, fut))
            elif not fut.done():
                fut.set_result(reply)
        self._waiters[gpu] = keep

    def _task_done(self, task: asyncio.Task[None]) -> None:
        for gpu in [g for g, t in self._tasks.items() if t is task]:
            del self._tasks[gpu]  # a task that broke: the next wish starts another
        if not task.cancelled() and task.exception() is not None:
            log.error("GPU report task %s failed", task.get_name(), exc_info=task.exception())

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()


def _health(healthy: bool) -> str:
    return "healthy" if healthy else "unhealthy"
