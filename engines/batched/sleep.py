"""Sleep/wake of the batched engine (issue 21): its KV cache's physical memory (level 2: its weights' too) given
back while every tensor keeps its address, so the model, the runner and CUDA graphs captured before sleeping
work unchanged after waking.

The control plane's ask arrives through the memory SDK (`MemoryClient.on_ask`, from a heartbeat reply) and is
handled on a thread of its own:
- quiesce: the engine stops taking requests (`state.state = "sleeping"`: /generate answers 503), waits until no
  sequence is live (at most `drain_s`; otherwise the ask is refused and the engine serves on), then parks its step
  thread between two steps (`LLMEngine.call_between_steps`): no step is in flight, and the journal, written
  step by step in the lease, holds no sequence.
- sleep: `MemoryClient.sleep` (the manager releases its side, then the pages are unmapped here, the addresses
  kept).
- wake: `MemoryClient.wake` maps new memory at the same addresses (weights filled from their copy); the KV
  cache's content is gone, so the journal is formatted again and the scheduler (its prefix cache names blocks
  whose KV was lost) starts afresh; then the step thread resumes and the engine is ready.

These quiesce and resume points are where a process checkpointer (CRIU with cuda-checkpoint) would hook:
docs/restore.md says what it would add.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from engines.batched.engine import LLMEngine
from engines.batched.scheduler import Scheduler
from libs.common.errors import Conflict
from libs.common.procs import ms_since

log = logging.getLogger("holdfast.engine.batched.sleep")


class EngineSleeper:
    def __init__(self, state: Any, engine: LLMEngine, client: Any, link: Any = None, *, drain_s: float = 30.0) -> None:
        self.state, self.engine, self.client, self.link = state, engine, client, link
        self.drain_s = drain_s
        self.level = 0  # 0: awake
        self._resume: threading.Event | None = None
        self._busy = threading.Lock()

    def on_ask(self, ask: Any) -> None:
        """From the SDK's heartbeat thread: never wait there."""
        threading.Thread(target=self._handle, args=(ask,), name=f"ask-{ask.op}", daemon=True).start()

    def _handle(self, ask: Any) -> None:
        try:
            with self._busy:
                info = self.sleep(ask.level, ask.id) if ask.op == "sleep" else self.wake(ask.id)
            self.state.info["sleep"] = info
            self.client.answer(ask.id)
        except Exception as e:  # noqa: BLE001 - every failure is the ask's answer, and the engine serves on
            log.warning("%s ask refused: %r", ask.op, e)
            self.client.answer(ask.id, e)

    def _leases(self, level: int) -> list[str]:
        return [lid for lid, lease in self.client.leases.items() if level >= 2 or lease.info.tag.value == "kv_cache"]

    def sleep(self, level: int, ask: str | None = None) -> dict[str, Any]:
        if self.level:
            raise Conflict(f"asleep already (level {self.level})")
        t0 = time.perf_counter()
        was, self.state.state = self.state.state, "sleeping"  # no new requests from here on
        try:
            self._drain()
            parked, self._resume = threading.Event(), threading.Event()
            resume = self._resume
            def park() -> None:
                parked.set()
                resume.wait()

            self.engine.call_between_steps(park)
            if not parked.wait(self.drain_s):
                raise Conflict("the step thread did not reach a step boundary")
            _synchronize(self.engine)
            reply = self.client.sleep(self._leases(level), ask=ask)
        except BaseException:
            if self._resume is not None:
                self._resume.set()
                self._resume = None
            self.state.state = was
            raise
        self.level = level
        self._tell_agent(True)  # a shadowing standby's mapping would keep the memory alive
        info = {"state": "sleeping", "level": level, "bytes": reply.bytes, "sleep_ms": ms_since(t0)}
        log.info("asleep (level %d): %d bytes released in %.1f ms", level, reply.bytes, info["sleep_ms"])
        return info

    def wake(self, ask: str | None = None) -> dict[str, Any]:
        if not self.level:
            raise Conflict("not asleep")
        t0 = time.perf_counter()
        source = self.client.wake(self._leases(self.level), ask=ask)
        self.engine.journal.format()  # the cache's memory is new: no sequence survives in it
        self.engine.scheduler = Scheduler(self.engine.scheduler.config)  # nor does any cached prefix block
        _synchronize(self.engine)
        assert self._resume is not None
        self._resume.set()
        self._resume, level, self.level = None, self.level, 0
        self.state.state = "ready"
        self._tell_agent(False)
        info = {"state": "awake", "level": level, "weights_source": source, "wake_ms": ms_since(t0)}
        log.info("awake (level %d) in %.1f ms%s", level, info["wake_ms"], f", weights from {source}" if source else "")
        return info

    def _tell_agent(self, sleeping: bool) -> None:
        if self.link is None:
            return
        try:
            self.link.asleep(sleeping)
        except Exception as e:  # noqa: BLE001 - the sleep itself stands; a shadow then lasts until its next pass
            log.warning("could not tell the agent the engine %s: %s", "sleeps" if sleeping else "woke", e)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_s
        while self.state.in_flight or self.engine.stats()["live"]:
            if time.monotonic() > deadline:
                raise Conflict(f"{self.state.in_flight} requests still in flight after {self.drain_s} s")
            time.sleep(0.01)


def install(state: Any, engine: LLMEngine, client: Any, link: Any = None) -> EngineSleeper:
    """Take the control plane's sleep and wake asks on this engine's memory client (and tell its agent, `link`)."""
    sleeper = EngineSleeper(state, engine, client, link)
    client.on_ask = sleeper.on_ask
    return sleeper


def _synchronize(engine: LLMEngine) -> None:
    kv = getattr(engine.runner, "kv", None)
    if kv is not None and kv.device.type == "cuda":
        import torch

        torch.cuda.synchronize(kv.device)

